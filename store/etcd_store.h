// The Store on etcd (docs/architecture.md "Store (store/)"): what many
// nodes' keelds and ranks share, so that no keel process holds the job's
// coordination; only etcd's replicated quorum does.
//
// Keys live under the address's prefix. Values written by add() are decimal
// text, as in the TCP store. compare_set and add are etcd transactions; wait
// and watch are etcd watches, never polls. Calls fail over between the
// members (etcd_gateway.h); add() is the one call never repeated after an
// attempt that may have applied.
#pragma once

#include "store/etcd_gateway.h"
#include "store/store.h"

namespace keel::store {

class EtcdStore final : public ClusterStore {
 public:
  explicit EtcdStore(EtcdOptions options);

  void set(const std::string& key, const std::string& value) override;
  std::optional<std::string> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  // Error(kInternal) when the key holds something other than an integer.
  int64_t add(const std::string& key, int64_t delta) override;
  std::optional<std::string> compare_set(const std::string& key, const std::optional<std::string>& expected,
                                         const std::string& desired) override;
  bool remove(const std::string& key) override;

  LeaseId grant_lease(std::chrono::seconds ttl) override;
  bool keep_alive(LeaseId lease, std::chrono::milliseconds timeout) override;
  void revoke(LeaseId lease) override;
  void set_with_lease(const std::string& key, const std::string& value, LeaseId lease) override;
  std::optional<std::string> compare_set_with_lease(const std::string& key, const std::optional<std::string>& expected,
                                                    const std::string& desired, LeaseId lease) override;
  Listing list(const std::string& prefix) override;
  std::vector<Change> watch(const std::string& prefix, int64_t after_revision,
                            std::chrono::milliseconds timeout) override;

 private:
  struct Read {
    int64_t revision = 0;  // the store's revision when read
    std::optional<std::string> value;
    int64_t mod_revision = 0;
  };
  // `timeout` bounds the call instead of the options' timeout.
  Read read(const std::string& key, std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  // The changes to etcd keys in [begin, end) after `after_revision`.
  std::vector<Change> watch_range(const std::string& begin, const std::string& end, int64_t after_revision,
                                  std::chrono::milliseconds timeout);
  std::optional<std::string> transact_set(const std::string& key, const std::optional<std::string>& expected,
                                          const std::string& desired, LeaseId lease);
  // The etcd key of a store key, base64 as the gateway takes it.
  std::string etcd_key(const std::string& key) const;
  std::string store_key(const std::string& etcd_key_base64) const;

  EtcdGateway gateway_;
};

}  // namespace keel::store
