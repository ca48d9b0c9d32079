// Scrapes keeld's Prometheus page over HTTP, as Prometheus would, for the
// tests that check what an operator's dashboards see.
#pragma once

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace keel::test {

struct Sample {
  std::string labels;  // what is between the braces, "" without
  double value = NAN;
};

// GET /metrics from keeld's port: the page's samples by metric name.
inline std::map<std::string, std::vector<Sample>> scrape(uint16_t port) {
  namespace asio = boost::asio;
  namespace http = boost::beast::http;
  asio::io_context io;
  asio::ip::tcp::socket socket(io);
  socket.connect({asio::ip::make_address("127.0.0.1"), port});
  http::request<http::empty_body> request{http::verb::get, "/metrics", 11};
  request.set(http::field::host, "127.0.0.1");
  http::write(socket, request);
  boost::beast::flat_buffer buffer;
  http::response<http::string_body> response;
  http::read(socket, buffer, response);
  REQUIRE(response.result_int() == 200);
  std::map<std::string, std::vector<Sample>> samples;
  std::istringstream page(response.body());
  for (std::string line; std::getline(page, line);) {
    if (line.empty() || line.starts_with("#")) continue;
    const size_t name_end = line.find_first_of("{ ");
    const size_t value_at = line.rfind(' ');
    REQUIRE_MESSAGE((name_end != std::string::npos && value_at != std::string::npos), line);
    Sample sample;
    if (line[name_end] == '{') sample.labels = line.substr(name_end + 1, line.find('}') - name_end - 1);
    sample.value = std::stod(line.substr(value_at + 1));
    samples[line.substr(0, name_end)].push_back(sample);
  }
  return samples;
}

// The one sample of a job-wide metric.
inline double value_of(const std::map<std::string, std::vector<Sample>>& samples, const std::string& name) {
  INFO(name);
  REQUIRE(samples.count(name) == 1);
  REQUIRE(samples.at(name).size() == 1);
  return samples.at(name)[0].value;
}

// A per-rank metric's value for each rank it names, by its rank label.
inline std::map<int, double> by_rank(const std::map<std::string, std::vector<Sample>>& samples, const std::string& name) {
  std::map<int, double> out;
  const auto it = samples.find(name);
  if (it == samples.end()) return out;
  for (const auto& s : it->second) {
    const size_t at = s.labels.find("rank=\"");
    if (at != std::string::npos) out[std::stoi(s.labels.substr(at + 6))] = s.value;
  }
  return out;
}

}  // namespace keel::test
