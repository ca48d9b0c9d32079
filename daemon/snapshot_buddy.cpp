#include "daemon/snapshot_buddy.h"

#include "common/thread_name.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <utility>

#include "common/error.h"
#include "common/log.h"

namespace keel::daemon {

using common::Error;
using common::ErrorCode;

namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using namespace buddy_wire;

spdlog::logger& buddy_log() {
  static const std::shared_ptr<spdlog::logger> instance = common::logger("snapshots");
  return *instance;
}

// Bounds on what a frame may claim before anything is allocated for it.
constexpr uint64_t kMaxTableBytes = 64ull << 20;
constexpr uint32_t kMaxPieces = 1u << 20;
constexpr uint64_t kMaxSentence = 4096;
constexpr int kMaxConnections = 16;
// A connection that says nothing this long is closed; a copy moves in
// chunks, each of which must arrive within it.
constexpr std::chrono::seconds kIoTimeout{60};
constexpr size_t kChunk = 4u << 20;
// How often the sender looks for a new copy step: a look is a few system
// calls a rank, and the ranks take no copy step after it until it is sent.
constexpr auto kLook = std::chrono::milliseconds(10);
// So a copy that failed is sent again, after a wait that doubles up to a
// minute with each failure.
constexpr auto kFirstRetry = std::chrono::seconds(1);
constexpr auto kLastRetry = std::chrono::seconds(60);

Frame frame_of(FrameKind kind, int64_t rank) {
  Frame f{};
  std::memcpy(f.magic, kMagic, sizeof(kMagic));
  f.kind = kind;
  f.rank = rank;
  return f;
}

Frame frame_of(FrameKind kind, int64_t rank, const checkpoint::SnapshotImage& image) {
  Frame f = frame_of(kind, rank);
  f.pieces = image.pieces;
  f.step = image.step;
  f.tokens = image.tokens;
  f.layout_hash = image.layout_hash;
  f.table_bytes = image.table.size();
  f.data_bytes = image.data_bytes;
  return f;
}

// Bytes of memory the kernel says it can give without swapping.
uint64_t memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

// A TCP connection driven step by step, each step bounded by a deadline
// and by `stop`, on an io_context of its own (so on whichever one thread
// uses it).
class Connection {
 public:
  explicit Connection(const std::atomic<bool>& stop) : stop_(stop), socket_(io_) {}
  tcp::socket& socket() { return socket_; }
  bool is_open() const { return socket_.is_open(); }
  void close() {
    boost::system::error_code ignored;
    socket_.close(ignored);
  }

  void connect(const std::string& endpoint, Clock::time_point deadline) {
    const size_t colon = endpoint.rfind(':');
    if (colon == std::string::npos) throw Error(ErrorCode::kPeerFailure, "no port in '" + endpoint + "'");
    tcp::resolver resolver(io_);
    boost::system::error_code ec;
    const auto found = resolver.resolve(endpoint.substr(0, colon), endpoint.substr(colon + 1), ec);
    if (ec) throw Error(ErrorCode::kPeerFailure, fmt::format("cannot resolve {}: {}", endpoint, ec.message()));
    wait(deadline, "connect to " + endpoint, [&](auto handler) {
      asio::async_connect(socket_, found, [handler](boost::system::error_code e, const tcp::endpoint&) { handler(e); });
    });
    socket_.set_option(tcp::no_delay(true));
  }
  void write(const void* data, size_t bytes, Clock::time_point deadline) {
    wait(deadline, "send", [&](auto handler) {
      asio::async_write(socket_, asio::buffer(data, bytes),
                        [handler](boost::system::error_code e, size_t) { handler(e); });
    });
  }
  void read(void* data, size_t bytes, Clock::time_point deadline) {
    wait(deadline, "receive", [&](auto handler) {
      asio::async_read(socket_, asio::buffer(data, bytes),
                       [handler](boost::system::error_code e, size_t) { handler(e); });
    });
  }
  // Reads a frame; false when the peer closed the connection between frames.
  bool read_frame(Frame& f, Clock::time_point deadline) {
    try {
      read(&f, sizeof(f), deadline);
    } catch (const Error&) {
      if (eof_) return false;
      throw;
    }
    if (std::memcmp(f.magic, kMagic, sizeof(kMagic)) != 0) {
      throw Error(ErrorCode::kPeerFailure, "a frame that is not keel's snapshot protocol");
    }
    return true;
  }

 private:
  template <class Start>
  void wait(Clock::time_point deadline, const std::string& what, Start start) {
    bool done = false;
    boost::system::error_code result;
    start([&](boost::system::error_code ec) {
      done = true;
      result = ec;
    });
    while (!done) {
      const auto now = Clock::now();
      if (stop_ || now >= deadline) {
        close();
        io_.restart();
        io_.run();  // the cancelled operation's handler
        throw Error(ErrorCode::kPeerFailure, fmt::format("{}: {}", what, stop_ ? "keeld is stopping" : "timed out"));
      }
      io_.restart();
      io_.run_for(std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(100)));
    }
    eof_ = result == asio::error::eof;
    if (result) {
      close();
      throw Error(ErrorCode::kPeerFailure, fmt::format("{}: {}", what, result.message()));
    }
  }

  const std::atomic<bool>& stop_;
  asio::io_context io_;
  tcp::socket socket_;
  bool eof_ = false;
};

Clock::time_point io_deadline() { return Clock::now() + kIoTimeout; }

// Reads the table and data a frame announces into an image; the frame's
// claims are bounded first.
std::shared_ptr<checkpoint::SnapshotImage> read_image(Connection& c, const Frame& f) {
  if (f.table_bytes > kMaxTableBytes || f.pieces > kMaxPieces) {
    throw Error(
        ErrorCode::kPeerFailure,
        fmt::format("a copy with a piece table of {} bytes and {} pieces, past every bound", f.table_bytes, f.pieces));
  }
  // Half of what the node has to spare: a copy must never push keeld, or
  // the ranks beside it, out of memory.
  const uint64_t spare = memory_available() / 2;
  if (f.data_bytes > spare) {
    throw Error(ErrorCode::kPeerFailure,
                fmt::format("a copy of {} bytes, more than half of the {} bytes this node has available", f.data_bytes,
                            spare * 2));
  }
  auto image = std::make_shared<checkpoint::SnapshotImage>();
  image->pieces = f.pieces;
  image->step = f.step;
  image->tokens = f.tokens;
  image->layout_hash = f.layout_hash;
  image->table.resize(f.table_bytes);
  c.read(image->table.data(), image->table.size(), io_deadline());
  image->data_bytes = f.data_bytes;
  image->data.reset(new unsigned char[f.data_bytes]);
  for (uint64_t at = 0; at < f.data_bytes; at += kChunk) {
    c.read(image->data.get() + at, std::min<uint64_t>(kChunk, f.data_bytes - at), io_deadline());
  }
  return image;
}

void write_image(Connection& c, const Frame& f, const checkpoint::SnapshotImage& image, double max_mb_per_s) {
  c.write(&f, sizeof(f), io_deadline());
  c.write(image.table.data(), image.table.size(), io_deadline());
  const auto began = Clock::now();
  for (uint64_t at = 0; at < image.data_bytes; at += kChunk) {
    const uint64_t n = std::min<uint64_t>(kChunk, image.data_bytes - at);
    c.write(image.data.get() + at, n, io_deadline());
    if (max_mb_per_s > 0) {
      // Paced: never ahead of the rate since the first byte.
      std::this_thread::sleep_until(began + std::chrono::duration<double>((at + n) / (max_mb_per_s * 1e6)));
    }
  }
}

}  // namespace

struct SnapshotBuddy::Server {
  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::thread thread;
  std::atomic<bool> stop{false};

  mutable std::mutex mutex;
  std::condition_variable sessions_done;
  int sessions = 0;
  int keep = 1;  // copies held a rank
  // Global rank -> the `keep` newest copies accepted, newest first.
  std::map<int64_t, std::deque<std::shared_ptr<const checkpoint::SnapshotImage>>> copies;

  std::deque<std::shared_ptr<const checkpoint::SnapshotImage>> copies_of(int64_t rank) const {
    std::lock_guard lock(mutex);
    const auto it = copies.find(rank);
    return it == copies.end() ? std::deque<std::shared_ptr<const checkpoint::SnapshotImage>>{} : it->second;
  }

  void accept(const std::shared_ptr<Server>& self) {
    auto connection = std::make_shared<Connection>(stop);
    acceptor.async_accept(connection->socket(), [self, connection](boost::system::error_code ec) {
      if (ec == asio::error::operation_aborted || self->stop) return;
      if (!ec) self->start_session(self, connection);
      self->accept(self);
    });
  }

  void start_session(const std::shared_ptr<Server>& self, std::shared_ptr<Connection> connection) {
    {
      std::lock_guard lock(mutex);
      if (sessions >= kMaxConnections) return;  // closed as it goes out of scope
      ++sessions;
    }
    common::named_thread("keel-buddy-conn", [self, connection] {
      try {
        self->serve(*connection);
      } catch (const std::exception& e) {
        if (!self->stop) buddy_log().warn("a snapshot copy connection ended: {}", e.what());
      }
      std::lock_guard lock(self->mutex);
      --self->sessions;
      self->sessions_done.notify_all();
    }).detach();
  }

  // One peer's pushes and fetches, in turn, until it hangs up.
  void serve(Connection& c) {
    Frame f{};
    while (c.read_frame(f, io_deadline())) {
      if (f.kind == kPush) {
        std::shared_ptr<checkpoint::SnapshotImage> image;
        std::optional<std::string> refused;
        try {
          image = read_image(c, f);
          refused = image->check(1);
        } catch (const Error& e) {
          refused = e.what();
        }
        if (refused) {
          if (!c.is_open()) throw Error(ErrorCode::kPeerFailure, *refused);  // the peer went: nobody to tell
          buddy_log().warn("refused the copy of rank {}'s snapshot of step {}: {}", f.rank, f.step, *refused);
          Frame answer = frame_of(kRefused, f.rank);
          const std::string said = refused->substr(0, kMaxSentence);
          answer.data_bytes = said.size();
          c.write(&answer, sizeof(answer), io_deadline());
          c.write(said.data(), said.size(), io_deadline());
          return;  // what is left of a push cut short cannot be told from a frame
        }
        {
          std::lock_guard lock(mutex);
          auto& held = copies[f.rank];
          // A copy of a step not after the ones held means the rank's run
          // went back (a resume from an older step): those are of a
          // history it no longer follows.
          std::erase_if(held, [&](const auto& copy) { return copy->step >= image->step; });
          held.push_front(std::move(image));
          while (static_cast<int>(held.size()) > keep) held.pop_back();
        }
        const Frame answer = frame_of(kAccepted, f.rank);
        c.write(&answer, sizeof(answer), io_deadline());
      } else if (f.kind == kFetch) {
        // Every copy held of the rank, newest first, then kNoCopy.
        for (const auto& copy : copies_of(f.rank)) write_image(c, frame_of(kCopy, f.rank, *copy), *copy, 0);
        const Frame end = frame_of(kNoCopy, f.rank);
        c.write(&end, sizeof(end), io_deadline());
      } else {
        throw Error(ErrorCode::kPeerFailure, fmt::format("a frame of unknown kind {}", f.kind));
      }
    }
  }
};

SnapshotBuddy::SnapshotBuddy(SnapshotBuddyOptions options)
    : options_(std::move(options)), server_(std::make_shared<Server>()) {
  // Two at least: a copy step's copies may arrive for one rank of a node
  // and not yet for the next, and the one before must still meet.
  server_->keep = std::max(options_.keep, 2);
  boost::system::error_code ec;
  tcp::resolver resolver(server_->io);
  const auto found = resolver.resolve(options_.address, std::to_string(options_.port), ec);
  if (ec || found.empty()) {
    throw Error(ErrorCode::kBadConfig, fmt::format("cluster.address '{}' names no address to take the snapshot "
                                                   "copies on: {}",
                                                   options_.address, ec.message()));
  }
  const tcp::endpoint at = found.begin()->endpoint();
  server_->acceptor.open(at.protocol(), ec);
  if (!ec) server_->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) server_->acceptor.bind(at, ec);
  if (!ec) server_->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    throw Error(ErrorCode::kBadConfig,
                fmt::format("cannot listen for snapshot copies on {}:{}: {}; set cluster.snapshot_port to a free port "
                            "(0: any)",
                            options_.address, options_.port, ec.message()));
  }
  server_->accept(server_);
  server_->thread = common::named_thread("keel-buddy-srv", [server = server_] { server->io.run(); });
  sender_ = common::named_thread("keel-buddy-send", [this] { send_until_stopped(); });
  fetcher_ = common::named_thread("keel-buddy-get", [this] { fetch_until_stopped(); });
}

SnapshotBuddy::~SnapshotBuddy() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  server_->stop = true;
  asio::post(server_->io, [server = server_] {
    boost::system::error_code ignored;
    server->acceptor.close(ignored);
  });
  server_->thread.join();
  sender_.join();
  fetcher_.join();
  std::unique_lock lock(server_->mutex);
  server_->sessions_done.wait(lock, [&] { return server_->sessions == 0; });
}

std::string SnapshotBuddy::endpoint() const {
  const auto at = server_->acceptor.local_endpoint();
  return fmt::format("{}:{}", at.address().to_string(), at.port());
}

void SnapshotBuddy::attach_areas(const std::vector<int>& area_fds) {
  std::lock_guard lock(mutex_);
  sent_.assign(area_fds.size(), std::nullopt);
  for (int fd : area_fds) {
    common::UniqueFd own(fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (own.get() < 0) {
      throw Error(ErrorCode::kInternal,
                  fmt::format("cannot hold a snapshot area for its copies: {}", std::strerror(errno)));
    }
    areas_.push_back(std::move(own));
  }
}

void SnapshotBuddy::send_to(const std::string& node, const std::string& endpoint, int64_t first_rank) {
  std::lock_guard lock(mutex_);
  buddy_node_ = node;
  buddy_endpoint_ = endpoint;
  first_rank_ = first_rank;
  // What the areas hold now is another generation's, whatever its step.
  floors_.clear();
  for (const auto& area : areas_) {
    floors_.push_back(checkpoint::SnapshotArea(area.get(), options_.keep).last_sequence());
  }
  retry_at_.reset();
  failing_.reset();
  ++pointed_;
  wake_.notify_all();
}

std::optional<SnapshotBuddy::CommonStep> SnapshotBuddy::common_step() const {
  // Per step of this generation's copy steps in every area so far: whether
  // each area's slot of it is marked held.
  std::optional<std::map<int64_t, std::vector<bool>>> common;
  for (size_t i = 0; i < areas_.size(); ++i) {
    std::map<int64_t, bool> steps;
    for (const auto& l : checkpoint::SnapshotArea(areas_[i].get(), options_.keep).list()) {
      if (l.copy_step && l.sequence > floors_[i]) steps[l.step] = l.copied;
    }
    if (!common) {
      common.emplace();
      for (const auto& [step, held] : steps) (*common)[step] = {held};
      continue;
    }
    std::erase_if(*common, [&](const auto& entry) { return !steps.contains(entry.first); });
    for (auto& [step, held] : *common) held.push_back(steps.at(step));
  }
  if (!common || common->empty()) return std::nullopt;
  const auto& [step, held] = *common->rbegin();
  return CommonStep{step, held};
}

void SnapshotBuddy::send_until_stopped() {
  // The copies yield to everything else on the node: training's threads,
  // keeld's loop, and (DSCP CS1 on the socket) the job's collectives. Nice
  // 19 rather than SCHED_IDLE, which starved the copy whenever the holder's
  // receiving thread shared its core (1.1 GB took 3x as long on the CI VM).
  setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), 19);
  std::unique_lock lock(mutex_);
  while (!stop_) {
    wake_.wait_for(lock, kLook);
    if (stop_ || buddy_endpoint_.empty()) continue;
    const auto common = common_step();
    if (!common) continue;
    const int64_t step = common->step;
    if (std::all_of(common->held.begin(), common->held.end(), [](bool held) { return held; })) {
      if (failing_ && failing_->step <= step) failing_.reset();
      continue;
    }
    // The ranks take no copy step after this one until it is held.
    const bool again = failing_ && failing_->step == step;
    if (again && Clock::now() < *retry_at_) continue;
    retry_wait_ = again ? std::min(2 * retry_wait_, Clock::duration(kLastRetry)) : kFirstRetry;
    const uint64_t pointed = pointed_;
    lock.unlock();
    auto why = send_step(step, common->held);
    lock.lock();
    // A new generation began meanwhile: its own copy steps go next.
    if (pointed != pointed_) continue;
    if (!why) {
      retry_at_.reset();
      failing_.reset();
      continue;
    }
    retry_at_ = Clock::now() + retry_wait_;
    failing_ = CopyFailure{step, again ? failing_->tries + 1 : 1, std::move(*why)};
  }
}

std::optional<std::string> SnapshotBuddy::send_step(int64_t step, const std::vector<bool>& already_held) {
  std::string node, endpoint;
  int64_t first_rank = 0;
  uint64_t pointed = 0;
  {
    std::lock_guard lock(mutex_);
    node = buddy_node_;
    endpoint = buddy_endpoint_;
    first_rank = first_rank_;
    pointed = pointed_;
  }
  // One connection for the node's copies of the step; a buddy that
  // restarted is found again at the next try, with no state kept here.
  Connection c(server_->stop);
  size_t held = 0;
  std::string why;
  try {
    c.connect(endpoint, io_deadline());
    const int tos = 0x20;  // DSCP CS1, "lower effort" (RFC 8622)
    setsockopt(c.socket().native_handle(), IPPROTO_IP, IP_TOS, &tos, sizeof(tos));
    for (size_t local = 0; local < areas_.size(); ++local) {
      const int64_t rank = first_rank + static_cast<int64_t>(local);
      if (already_held[local]) {  // by an earlier try
        ++held;
        continue;
      }
      // One image at a time: each costs a rank's state in memory.
      const auto image = checkpoint::SnapshotArea(areas_[local].get(), options_.keep).image_of(step);
      if (!image) continue;  // gone meanwhile (the slot of a rank that began anew): tried again
      const auto began = Clock::now();
      write_image(c, frame_of(kPush, rank, *image), *image, options_.max_mb_per_s);
      Frame answer{};
      if (!c.read_frame(answer, io_deadline())) throw Error(ErrorCode::kPeerFailure, "it hung up");
      if (answer.kind == kRefused) {
        std::string said(std::min<uint64_t>(answer.data_bytes, kMaxSentence), '\0');
        c.read(said.data(), said.size(), io_deadline());
        throw Error(ErrorCode::kPeerFailure, fmt::format("it refused rank {}'s: {}", rank, said));
      }
      if (answer.kind != kAccepted) throw Error(ErrorCode::kPeerFailure, "it answered with an unknown frame");
      const double seconds = std::chrono::duration<double>(Clock::now() - began).count();
      std::lock_guard lock(mutex_);
      // The rank votes for its next copy step once this one is held. Not
      // after the sender was pointed anew: that is the last generation's.
      if (pointed != pointed_) break;
      sent_[local] = SentCopy{rank, step, image->data_bytes, seconds, node};
      if (checkpoint::SnapshotArea(areas_[local].get(), options_.keep).mark_copied(step, image->sequence)) ++held;
    }
  } catch (const Error& e) {
    why = e.what();
    if (!server_->stop) {
      buddy_log().warn("could not copy the snapshots of step {} to node '{}' ({}): {}", step, node, endpoint, e.what());
    }
  }
  if (held == areas_.size()) return std::nullopt;
  return why.empty() ? "a rank's snapshot of the step is no longer in its area" : why;
}

std::optional<CopyFailure> SnapshotBuddy::failing() const {
  std::lock_guard lock(mutex_);
  return failing_;
}

void SnapshotBuddy::fetch(std::vector<int> locals, int64_t first_rank, std::vector<Holder> holders,
                          std::chrono::milliseconds within, std::function<void(FetchedCopies)> done) {
  std::lock_guard lock(mutex_);
  fetches_.push_back(
      [this, locals = std::move(locals), first_rank, holders = std::move(holders), within, done = std::move(done)] {
        const auto began = Clock::now();
        const auto deadline = began + within;
        FetchedCopies out;
        std::vector<int> missing;
        // Writes a rank's copies (newest first) into its area; `received_s`:
        // how long they took to come and verify.
        using Copies = std::deque<std::shared_ptr<const checkpoint::SnapshotImage>>;
        auto fill = [&](int local, const Copies& copies, const std::string& from, double received_s) {
          const auto writing = Clock::now();
          std::vector<const checkpoint::SnapshotImage*> oldest_first;
          std::vector<int64_t> steps;
          uint64_t bytes = 0;
          for (auto it = copies.rbegin(); it != copies.rend(); ++it) {
            oldest_first.push_back(it->get());
            steps.insert(steps.begin(), (*it)->step);
            bytes += (*it)->data_bytes;
          }
          checkpoint::SnapshotArea(areas_[static_cast<size_t>(local)].get(), options_.keep, /*copied=*/true)
              .import(oldest_first);
          out.filled.push_back({local, first_rank + local, steps, bytes, from, received_s,
                                std::chrono::duration<double>(Clock::now() - writing).count()});
        };
        // This node's own copies first: its ranks may be the ones its buddy had.
        for (int local : locals) {
          const auto own = server_->copies_of(first_rank + local);
          if (own.empty()) {
            missing.push_back(local);
            continue;
          }
          try {
            fill(local, own, "this node", 0);
          } catch (const Error& e) {
            out.problems.push_back(fmt::format("rank {}: {}", first_rank + local, e.what()));
          }
        }
        for (const Holder& holder : holders) {
          if (missing.empty() || holder.endpoint.empty()) continue;
          std::vector<int> still;
          Connection c(server_->stop);
          try {
            c.connect(holder.endpoint, std::min(deadline, io_deadline()));
            for (int local : missing) {
              const int64_t rank = first_rank + local;
              const Frame ask = frame_of(kFetch, rank);
              c.write(&ask, sizeof(ask), deadline);
              const auto receiving = Clock::now();
              Copies copies;  // newest first, as the holder sends them
              for (Frame answer{}; true;) {
                if (!c.read_frame(answer, deadline)) throw Error(ErrorCode::kPeerFailure, "it hung up");
                if (answer.kind == kNoCopy) break;
                if (answer.kind != kCopy || answer.rank != rank) {
                  throw Error(ErrorCode::kPeerFailure, "it answered with a frame that is no copy of that rank");
                }
                auto image = read_image(c, answer);
                if (const auto why = image->check(0)) {
                  out.problems.push_back(
                      fmt::format("rank {}: node '{}' held a copy that does not verify: {}", rank, holder.node, *why));
                  continue;
                }
                copies.push_back(std::move(image));
              }
              if (copies.empty()) {
                still.push_back(local);
                continue;
              }
              fill(local, copies, holder.node, std::chrono::duration<double>(Clock::now() - receiving).count());
            }
          } catch (const Error& e) {
            out.problems.push_back(fmt::format("node '{}' ({}): {}", holder.node, holder.endpoint, e.what()));
            for (int local : missing) {
              const bool filled = std::any_of(out.filled.begin(), out.filled.end(),
                                              [&](const FetchedCopies::Filled& f) { return f.local == local; });
              if (!filled && std::find(still.begin(), still.end(), local) == still.end()) still.push_back(local);
            }
          }
          missing = std::move(still);
        }
        for (int local : missing) out.absent.push_back(first_rank + local);
        out.seconds = std::chrono::duration<double>(Clock::now() - began).count();
        options_.post([done, out = std::move(out)] { done(out); });
      });
  wake_.notify_all();
}

void SnapshotBuddy::fetch_until_stopped() {
  std::unique_lock lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] { return stop_ || !fetches_.empty(); });
    if (stop_) return;
    auto next = std::move(fetches_.front());
    fetches_.pop_front();
    lock.unlock();
    next();
    lock.lock();
  }
}

std::vector<HeldCopy> SnapshotBuddy::held() const {
  std::lock_guard lock(server_->mutex);
  std::vector<HeldCopy> out;
  for (const auto& [rank, copies] : server_->copies) {
    for (const auto& image : copies) out.push_back({rank, image->step, image->data_bytes});
  }
  return out;
}

std::vector<std::optional<SentCopy>> SnapshotBuddy::sent() const {
  std::lock_guard lock(mutex_);
  return sent_;
}

int SnapshotBuddy::drop_after(int64_t step) {
  std::lock_guard lock(server_->mutex);
  int dropped = 0;
  for (auto& [rank, copies] : server_->copies) {
    dropped += static_cast<int>(std::erase_if(copies, [&](const auto& copy) { return copy->step > step; }));
  }
  std::erase_if(server_->copies, [](const auto& entry) { return entry.second.empty(); });
  return dropped;
}

}  // namespace keel::daemon
