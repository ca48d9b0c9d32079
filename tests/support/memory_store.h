// The Store contract of store/store.h in memory, for tests whose ranks are
// threads of one process. Thread-safe; header-only so a test executable needs
// no more than the include.
#pragma once

#include "common/error.h"
#include "store/store.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace keel::test {

class MemoryStore final : public store::Store {
 public:
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mutex_);
    values_[key] = value;
    changed_.notify_all();
  }

  std::optional<std::string> get(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = values_.find(key);
    if (it == values_.end()) return std::nullopt;
    return it->second;
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    auto all_present = [&] {
      for (const auto& key : keys) {
        if (!values_.count(key)) return false;
      }
      return true;
    };
    if (!changed_.wait_for(lock, timeout, all_present)) {
      std::string missing;
      for (const auto& key : keys) {
        if (!values_.count(key)) missing += " " + key;
      }
      throw common::Error(common::ErrorCode::kPeerFailure, "store wait timed out; missing:" + missing);
    }
  }

  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = values_.find(key);
    int64_t value = (it == values_.end() ? 0 : std::stoll(it->second)) + delta;
    values_[key] = std::to_string(value);
    changed_.notify_all();
    return value;
  }

  std::optional<std::string> compare_set(const std::string& key, const std::optional<std::string>& expected,
                                         const std::string& desired) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = values_.find(key);
    std::optional<std::string> current;
    if (it != values_.end()) current = it->second;
    if (current == expected) {
      values_[key] = desired;
      changed_.notify_all();
      return desired;
    }
    return current;
  }

  bool remove(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return values_.erase(key) > 0;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
};

}  // namespace keel::test
