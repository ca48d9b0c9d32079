#include "store/etcd_store.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <exception>
#include <utility>

#include "common/error.h"

namespace keel::store {

using common::Error;
using common::ErrorCode;
using nlohmann::json;
using Retry = EtcdGateway::Retry;

namespace {

// The first key after every key that starts with `prefix`: etcd's range_end
// for a prefix (the last byte below 0xff incremented, the rest dropped).
std::string prefix_end(std::string prefix) {
  while (!prefix.empty()) {
    auto& last = reinterpret_cast<unsigned char&>(prefix.back());
    if (last < 0xff) {
      ++last;
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

// Runs `interpret` on an answer of etcd's; an answer missing a field or
// holding one of the wrong type is etcd's fault (or a proxy's), and a rank
// that cannot read its store cannot train: kPeerFailure, never a crash.
template <class Interpret>
auto read_answer(const EtcdGateway& gateway, std::string_view what, Interpret interpret) {
  try {
    return interpret();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kPeerFailure, fmt::format("etcd at {} gave an answer to {} that keel cannot read: {}",
                                                     gateway.endpoint_names(), what, e.what()));
  }
}

const json& field(const json& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end()) throw std::invalid_argument(std::string("it has no '") + name + "'");
  return *it;
}

std::string quoted(const std::string& key) { return "'" + key + "'"; }

}  // namespace

EtcdStore::EtcdStore(EtcdOptions options) : gateway_(std::move(options)) {
  // Reaching the cluster now turns a wrong address into an error at start
  // rather than at the first rendezvous.
  gateway_.call("/v3/maintenance/status", json::object(), Retry::kIdempotent);
}

std::string EtcdStore::etcd_key(const std::string& key) const { return etcd_base64(gateway_.options().prefix + key); }

std::string EtcdStore::store_key(const std::string& etcd_key_base64) const {
  std::string key = etcd_unbase64(etcd_key_base64);
  const std::string& prefix = gateway_.options().prefix;
  if (key.compare(0, prefix.size(), prefix) != 0) throw std::invalid_argument("a key outside the prefix: " + key);
  return key.substr(prefix.size());
}

void EtcdStore::set(const std::string& key, const std::string& value) { set_with_lease(key, value, 0); }

void EtcdStore::set_with_lease(const std::string& key, const std::string& value, LeaseId lease) {
  json body = {{"key", etcd_key(key)}, {"value", etcd_base64(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  gateway_.call("/v3/kv/put", body, Retry::kIdempotent);
}

EtcdStore::Read EtcdStore::read(const std::string& key, std::optional<std::chrono::milliseconds> timeout) {
  json answer = gateway_.call("/v3/kv/range", {{"key", etcd_key(key)}}, Retry::kIdempotent, timeout);
  return read_answer(gateway_, "a read of " + quoted(key), [&] {
    Read result;
    result.revision = etcd_int(field(answer, "header"), "revision");
    if (auto kvs = answer.find("kvs"); kvs != answer.end() && !kvs->empty()) {
      const json& kv = kvs->at(0);
      result.value = etcd_unbase64(kv.value("value", ""));
      result.mod_revision = etcd_int(kv, "mod_revision");
    }
    return result;
  });
}

std::optional<std::string> EtcdStore::get(const std::string& key) { return read(key).value; }

void EtcdStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::string> missing;
  for (const auto& key : keys) {
    // Each read within what is left of the wait (at least one attempt's
    // worth), so an etcd out of reach costs the wait's timeout, not a call
    // timeout per key.
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    Read current = read(key, std::min(std::max(left, std::chrono::milliseconds(500)), gateway_.options().timeout));
    int64_t seen = current.revision;
    bool present = current.value.has_value();
    while (!present) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      // Only this key: a prefix watch would also wake for its siblings.
      const std::string full = gateway_.options().prefix + key;
      for (const Change& change : watch_range(full, full + '\0', seen, left)) {
        seen = change.revision;
        present = change.value.has_value();
      }
    }
    if (!present) missing.push_back(key);
  }
  if (!missing.empty()) {
    std::string names;
    for (const auto& key : missing) names += (names.empty() ? "" : ", ") + quoted(key);
    throw Error(ErrorCode::kPeerFailure,
                fmt::format("store wait timed out after {} ms; still missing: {}. The ranks (or keelds) that set them "
                            "have not arrived: check that every rank of the job started, and read their logs",
                            timeout.count(), names));
  }
}

int64_t EtcdStore::add(const std::string& key, int64_t delta) {
  for (;;) {
    Read current = read(key);
    int64_t value = 0;
    if (current.value) {
      const std::string& text = *current.value;
      auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
      if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
        throw Error(ErrorCode::kInternal, fmt::format("store add to {}: its value is not an integer", quoted(key)));
      }
    }
    const std::string next = std::to_string(value + delta);
    // The put happens only if nobody changed the key since the read
    // (absent: never created); otherwise read again.
    json compare =
        current.value
            ? json{{"target", "MOD"}, {"key", etcd_key(key)}, {"mod_revision", std::to_string(current.mod_revision)}}
            : json{{"target", "CREATE"}, {"key", etcd_key(key)}, {"create_revision", "0"}};
    json body = {{"compare", json::array({compare})},
                 {"success", json::array({{{"request_put", {{"key", etcd_key(key)}, {"value", etcd_base64(next)}}}}})}};
    json answer = gateway_.call("/v3/kv/txn", body, Retry::kOnce);
    if (answer.value("succeeded", false)) return value + delta;
  }
}

std::optional<std::string> EtcdStore::compare_set(const std::string& key, const std::optional<std::string>& expected,
                                                  const std::string& desired) {
  return transact_set(key, expected, desired, 0);
}

std::optional<std::string> EtcdStore::compare_set_with_lease(const std::string& key,
                                                             const std::optional<std::string>& expected,
                                                             const std::string& desired, LeaseId lease) {
  return transact_set(key, expected, desired, lease);
}

std::optional<std::string> EtcdStore::transact_set(const std::string& key, const std::optional<std::string>& expected,
                                                   const std::string& desired, LeaseId lease) {
  json compare = expected ? json{{"target", "VALUE"}, {"key", etcd_key(key)}, {"value", etcd_base64(*expected)}}
                          : json{{"target", "CREATE"}, {"key", etcd_key(key)}, {"create_revision", "0"}};
  json put = {{"key", etcd_key(key)}, {"value", etcd_base64(desired)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  json body = {{"compare", json::array({compare})},
               {"success", json::array({{{"request_put", put}}})},
               {"failure", json::array({{{"request_range", {{"key", etcd_key(key)}}}}})}};
  // Repeating it after an attempt that applied finds the value desired, not
  // expected, and answers that value: what the call returns either way.
  json answer = gateway_.call("/v3/kv/txn", body, Retry::kIdempotent);
  return read_answer(gateway_, "a compare-and-set of " + quoted(key), [&]() -> std::optional<std::string> {
    if (answer.value("succeeded", false)) return desired;
    const json& responses = field(answer, "responses");
    const json& range = field(responses.at(0), "response_range");
    auto kvs = range.find("kvs");
    if (kvs == range.end() || kvs->empty()) return std::nullopt;
    return etcd_unbase64(kvs->at(0).value("value", ""));
  });
}

bool EtcdStore::remove(const std::string& key) {
  json answer = gateway_.call("/v3/kv/deleterange", {{"key", etcd_key(key)}}, Retry::kIdempotent);
  return read_answer(gateway_, "a delete of " + quoted(key), [&] { return etcd_int(answer, "deleted") > 0; });
}

ClusterStore::LeaseId EtcdStore::grant_lease(std::chrono::seconds ttl) {
  // A repeated grant leaves an unused lease behind, which expires by itself.
  json answer = gateway_.call("/v3/lease/grant", {{"TTL", ttl.count()}}, Retry::kIdempotent);
  return read_answer(gateway_, "a lease grant", [&] {
    LeaseId id = etcd_int(answer, "ID");
    if (id == 0) throw std::invalid_argument("it granted lease 0");
    return id;
  });
}

bool EtcdStore::keep_alive(LeaseId lease, std::chrono::milliseconds timeout) {
  json answer = gateway_.call("/v3/lease/keepalive", {{"ID", std::to_string(lease)}}, Retry::kIdempotent, timeout);
  // The gateway answers with one stream message; an expired lease has no TTL.
  return read_answer(gateway_, "a lease renewal", [&] { return etcd_int(field(answer, "result"), "TTL") > 0; });
}

void EtcdStore::revoke(LeaseId lease) {
  try {
    gateway_.call("/v3/lease/revoke", {{"ID", std::to_string(lease)}}, Retry::kIdempotent);
  } catch (const Error& e) {
    // Gone already: expired, or an earlier attempt of this call revoked it.
    if (std::string_view(e.what()).find("lease not found") == std::string_view::npos) throw;
  }
}

ClusterStore::Listing EtcdStore::list(const std::string& prefix) {
  const std::string full = gateway_.options().prefix + prefix;
  json answer = gateway_.call(
      "/v3/kv/range", {{"key", etcd_base64(full)}, {"range_end", etcd_base64(prefix_end(full))}}, Retry::kIdempotent);
  return read_answer(gateway_, "a listing of " + quoted(prefix), [&] {
    Listing listing;
    listing.revision = etcd_int(field(answer, "header"), "revision");
    if (auto kvs = answer.find("kvs"); kvs != answer.end()) {
      for (const json& kv : *kvs) {
        listing.entries.push_back({store_key(field(kv, "key").get<std::string>()), etcd_unbase64(kv.value("value", "")),
                                   etcd_int(kv, "mod_revision")});
      }
    }
    return listing;
  });
}

std::vector<ClusterStore::Change> EtcdStore::watch(const std::string& prefix, int64_t after_revision,
                                                   std::chrono::milliseconds timeout) {
  const std::string full = gateway_.options().prefix + prefix;
  return watch_range(full, prefix_end(full), after_revision, timeout);
}

std::vector<ClusterStore::Change> EtcdStore::watch_range(const std::string& begin, const std::string& end,
                                                         int64_t after_revision, std::chrono::milliseconds timeout) {
  int64_t seen = after_revision;
  std::vector<Change> changes;
  // A watch that reconnects to another member resumes after what it saw.
  auto body = [&] {
    return json{
        {"create_request",
         {{"key", etcd_base64(begin)}, {"range_end", etcd_base64(end)}, {"start_revision", std::to_string(seen + 1)}}}};
  };
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // etcd cancels a watch whose token expired instead of refusing it; one
  // new token, and the watch again.
  bool token_expired = false, authenticated_again = false;
  auto on_message = [&](const json& message) {
    return read_answer(gateway_, "a watch", [&] {
      if (auto error = message.find("error"); error != message.end()) {
        throw Error(ErrorCode::kPeerFailure, "etcd ended a watch: " + error->dump());
      }
      const json& result = field(message, "result");
      if (int64_t compacted = etcd_int(result, "compact_revision"); compacted > 0) {
        throw HistoryCompacted(compacted,
                               fmt::format("etcd compacted its history to revision {}, past the revision {} a watch "
                                           "resumes from: its changes since are lost",
                                           compacted, seen + 1));
      }
      if (result.value("canceled", false)) {
        const std::string reason = result.value("cancel_reason", std::string());
        if (!authenticated_again && reason.find("invalid auth token") != std::string::npos) {
          token_expired = true;
          return false;
        }
        throw Error(ErrorCode::kPeerFailure, "etcd canceled a watch: " + reason);
      }
      auto events = result.find("events");
      if (events == result.end()) return true;  // created, or a progress note: keep reading
      for (const json& event : *events) {
        const json& kv = field(event, "kv");
        Change change{store_key(field(kv, "key").get<std::string>()), std::nullopt, etcd_int(kv, "mod_revision")};
        if (event.value("type", std::string("PUT")) != "DELETE") change.value = etcd_unbase64(kv.value("value", ""));
        seen = std::max(seen, change.revision);
        changes.push_back(std::move(change));
      }
      return false;
    });
  };
  gateway_.stream("/v3/watch", body, deadline, on_message);
  if (token_expired) {
    gateway_.authenticate_again();
    authenticated_again = true;
    gateway_.stream("/v3/watch", body, deadline, on_message);
  }
  return changes;
}

}  // namespace keel::store
