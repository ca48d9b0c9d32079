// Streams: where a backend's work runs, in order (docs/architecture.md
// "Streams"). A rank has a compute stream (the backend's kernels), one
// communication stream per process group (the communicator's collectives)
// and a copy stream (checkpoint staging). Work on one stream runs in the
// order it was queued; an event marks a point in a stream, and another
// stream can be made to wait for it without blocking the host.
//
// On the CPU the backend's kernels run on the calling thread, so compute
// work is done when the call returns: its events are complete when
// recorded, and waiting for one costs nothing. A communicator's stream is a
// thread of its own there (communicator.h). On CUDA a stream is a
// cudaStream_t and an event a cudaEvent_t.
#pragma once

#include <memory>

namespace keel::trainer {

class StreamEvent {
 public:
  virtual ~StreamEvent() = default;
  // Blocks the calling thread until the work before the event has completed.
  virtual void synchronize() = 0;
};

class Stream {
 public:
  virtual ~Stream() = default;
  // An event at the end of the work queued on this stream so far.
  virtual std::shared_ptr<StreamEvent> record() = 0;
  // Work queued on this stream from now on starts only after `event`,
  // recorded on another stream of the same backend, has completed.
  virtual void wait(StreamEvent& event) = 0;
  // Blocks the calling thread until the work queued so far has completed.
  virtual void synchronize() = 0;
};

// The stream of work that is done when it is queued: host code run by the
// thread that queues it.
class HostStream final : public Stream {
 public:
  std::shared_ptr<StreamEvent> record() override;
  void wait(StreamEvent&) override {}
  void synchronize() override {}
};

}  // namespace keel::trainer
