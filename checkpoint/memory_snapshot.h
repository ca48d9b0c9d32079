// A rank's in-memory snapshots (docs/architecture.md "In-memory
// snapshots"): copies of its training state in one shared
// memory file that keeld owns (a memfd), so that they outlive the rank's
// crash and the next generation resumes from them without storage.
//
// The file holds `keep` + 1 slots. A snapshot goes into a slot that is not
// one of the `keep` newest complete ones; begin() marks it writing, the
// caller copies the pieces in, and commit() hashes every piece (XXH3-64)
// and marks it complete with a release store. A rank killed between the
// two leaves that slot writing, never read, and the others whole. A slot is
// read only after every piece's hash is checked again.
//
// An area whose snapshots keeld copies to another node (`copied`, the
// buddy copy) holds two more slots: the ranks agree on which snapshots are
// copy steps, keeld copies only those and marks each slot its buddy
// accepted, and the two newest copy steps stay beside the `keep` newest, so
// that every node still holds the steps the copies are of.
//
// keeld opens the same file to list the slots (keelctl checkpoint) and to
// quarantine those after an SDC verdict's last good step; an area is a view
// of the file as it was when made (or at its last begin()), so keeld makes
// one for each look. Nothing in the
// file is trusted: a header, a piece table or a size that does not add up
// makes that slot (or the whole area) unusable with a sentence, never a
// crash or a read past the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/piece.h"

namespace keel::checkpoint {

// One complete slot as bytes, to send to another node's keeld (the buddy
// copy, docs/architecture.md "In-memory snapshots": "Many nodes") and to
// write into an area there. Nothing in it is trusted until check() passes.
struct SnapshotImage {
  int64_t step = -1;
  int64_t tokens = 0;
  uint64_t layout_hash = 0;
  uint32_t pieces = 0;
  std::string table;  // each piece's XXH3-64 (8 bytes), then the piece table as JSON
  std::unique_ptr<unsigned char[]> data;  // the pieces' floats as a slot lays them out
  size_t data_bytes = 0;
  uint64_t sequence = 0;  // of the slot it was copied from, for mark_copied(); never sent

  // Why the image cannot be a snapshot (a table that does not parse, data
  // of another size than the table says, a piece that fails its hash);
  // nullopt when it can. `threads` share the hashing.
  std::optional<std::string> check(unsigned threads = 1) const;
};

class SnapshotArea {
 public:
  // What a complete slot says of itself, from its header alone.
  struct Listed {
    int slot = 0;
    int64_t step = -1;
    int64_t tokens = 0;
    uint64_t sequence = 0;  // higher: committed later
    uint64_t bytes = 0;     // of its pieces
    bool copy_step = false;  // the ranks agreed to copy it to the buddy
    bool copied = false;     // and the buddy accepted it
  };
  // A complete slot whose every piece verified.
  struct Snapshot {
    Listed listed;
    std::vector<Piece> pieces;
    std::vector<const float*> data;  // each piece's floats, in the area
  };
  // The slots read back: the ones that verified, newest first, and a
  // sentence for each complete one that did not.
  struct Verified {
    std::vector<Snapshot> snapshots;
    std::vector<std::string> problems;
  };

  // Over `fd` (not owned; a memfd keeld made, empty until the first
  // snapshot), keeping the `keep` newest snapshots (at least 1), and with
  // `copied` the two newest copy steps as well.
  SnapshotArea(int fd, int keep, bool copied = false);
  ~SnapshotArea();
  SnapshotArea(const SnapshotArea&) = delete;
  SnapshotArea& operator=(const SnapshotArea&) = delete;

  // Makes the area hold `keep` + 1 snapshots of `pieces`: when the state's
  // shape differs from the area's (the first snapshot, another layout) the
  // area is laid out afresh, its pages taken and touched, and what it held
  // is gone. Error(kCheckpointFailure) when the file cannot grow (memory).
  void reserve(const std::vector<Piece>& pieces);
  // As reserve(), then lays out the next snapshot for `pieces` and returns
  // where each piece's floats go. `copy_step`: the ranks agreed to copy it.
  std::vector<float*> begin(const std::vector<Piece>& pieces, uint64_t layout_hash, bool copy_step = false);
  // Hashes the pieces begun and marks the slot complete as step `step`.
  // A piece holding a non-finite value leaves the slot unfinished (never
  // read) and is named in the sentence returned: no snapshot holds
  // non-finite state.
  // `threads` share the hashing (0: every CPU this process may run on).
  std::optional<std::string> commit(int64_t step, int64_t tokens, unsigned threads = 1);

  // The complete slots, newest first.
  std::vector<Listed> list() const;
  // The newest sequence the file has given a slot (0: none), across
  // lay-outs: the slots committed after this call have higher ones.
  uint64_t last_sequence() const;
  // The complete slots of `layout_hash` whose pieces verify, hashed over
  // `threads` threads.
  Verified verified(uint64_t layout_hash, unsigned threads = 1) const;
  // Marks every complete slot of a step after `step` quarantined (never
  // read again); returns how many.
  int quarantine_after(int64_t step);

  // A copy of the newest complete slot of `step`, taken while the rank may
  // be writing another: nullopt when there is none, or when the rank began
  // overwriting it during the copy.
  std::optional<SnapshotImage> image_of(int64_t step) const;
  // Marks the slot an image_of() came from (its step and sequence) copied:
  // the buddy holds it. False when the slot holds another snapshot by now.
  bool mark_copied(int64_t step, uint64_t sequence);
  // Writes `images` (check()ed by the caller; one rank's, oldest first, at
  // most `keep`) into the area as its only complete slots (what it held was
  // another rank's), laying the area out for them when its shape differs,
  // as a rank's begin() would; they are copy steps, and copied. Only while
  // no rank uses the area.
  // Error(kCheckpointFailure) when the file cannot grow.
  void import(const std::vector<const SnapshotImage*>& images);

  // The file's mapping (null and 0 before the first snapshot), for a
  // backend that registers it for device copies. begin() may move it.
  void* mapping() const { return base_; }
  size_t mapping_bytes() const { return mapped_; }

 private:
  // Lays the area out afresh unless it holds `pieces` pieces whose table
  // is `json_bytes` of JSON and whose floats take `data_bytes` a slot.
  void fit(size_t pieces, size_t json_bytes, size_t data_bytes);
  // Maps what the file holds when its header adds up (false: nothing usable).
  bool map_existing();
  // Sizes and maps the file for slot_count() slots of this much table and
  // data, every slot empty.
  void lay_out(size_t table_bytes, size_t data_bytes);
  void unmap();
  unsigned char* slot_at(int slot) const;
  // The slot the next snapshot goes into: not one of the `keep` newest
  // complete ones, nor of the two newest copy steps.
  int next_slot() const;
  // Marks the slot complete as the newest one.
  void complete(unsigned char* slot, int64_t step, int64_t tokens);
  // What a rank lays the area out with.
  int slot_count() const { return keep_ + 1 + copy_steps_kept_; }

  int fd_;
  int keep_;
  int copy_steps_kept_;            // 2 when copied, else 0
  unsigned char* base_ = nullptr;  // the mapping, or null
  size_t mapped_ = 0;
  int slots_ = 0;  // as the area's header says
  size_t slot_bytes_ = 0;
  size_t table_bytes_ = 0;
  int writing_ = -1;  // the slot begun and not committed
  std::vector<Piece> begun_;
  std::vector<size_t> begun_offsets_;  // of each piece's floats in the slot
};

// XXH3-64 of a layout's description, for SnapshotArea's layout check.
uint64_t layout_hash(const std::string& layout_json);

}  // namespace keel::checkpoint
