// The node-local slot table: the data plane of the crossover daemon.
//
// One table per daemon, a file in its 0700 runtime directory mapped shared by the
// daemon and every rank on the node. The daemon stays the one place that decides:
//
//  * Every request and release of a rank is appended, under the device's mutex, to the
//    device's event ring. The ring's order is the one order of events: the daemon
//    applies them to its pure scheduler in that order.
//  * After the daemon has applied every event up to position `seq`, it publishes a plan:
//    for each slot, the grants a request (or a release) of that slot would cause if it
//    were the very next event; and a chain: the events it expects next, in order (the
//    holder releases to communicate and asks again, the next holder does the same, ...)
//    with the grants of each in that sequence.
//  * An event at position `seq` executes its slot's answer; an event at `seq + i` that is
//    the chain's i-th, all before it having followed the chain too, executes the chain's
//    grants: it wakes the granted ranks (futex on their grant word). Any other event
//    waits for the daemon, which grants through the same grant words. So every grant is
//    the one the scheduler makes for the same sequence of events, and while the jobs
//    follow the chain the daemon is off the path: it is woken once per chain, not per
//    handoff.
//
// Crash safety: the mutexes are robust (a rank that dies inside one leaves it
// recoverable), an event is committed (tail advanced) before its grants are written, and
// grants are idempotent: a grant word holds the generation of the request it answers, so
// the daemon may write any grant again. A killed daemon's table is replaced at the next
// start (a new file, named in the welcome).
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace crossover {

constexpr uint64_t kMagic = 0x43524f5353545331ULL;  // "CROSSTS1"
constexpr uint32_t kVersion = 2;
constexpr int kMaxSlots = 63;  // ranks per node on the fast path (a bit mask each)
// In a plan's answer, beside the slots it grants: the event leaves the device free but
// waiting for the rank whose turn it is, which only the daemon's clock ends (patience),
// so the daemon must see it now, chain or not.
constexpr uint64_t kWake = uint64_t{1} << 63;
constexpr int kMaxDevices = 64;
constexpr uint64_t kRing = 256;  // events per device the daemon has not drained yet
constexpr uint32_t kChain = 32;  // events a plan looks ahead
constexpr uint32_t kRefill = 4;  // wake the daemon when this few chain events are left

enum EventKind : uint32_t { kRequest = 1, kRelease = 2 };

// Result bits of request()/release().
constexpr int kGranted = 1;  // the caller's own request was granted at once
constexpr int kRingDaemon = 2;  // the daemon has no wake-up pending: send one
// Errors (negative).
constexpr int kLockTimeout = -1;  // the device's mutex was not free in time
constexpr int kRingFull = -2;  // the daemon stopped draining
constexpr int kBadArgument = -3;
constexpr int kFenced = -4;  // the daemon gave up on this device's mutex: use the socket

struct Event {
  uint32_t slot;
  uint32_t kind;
  uint32_t phase;  // a release's phase (a code the Python side defines)
  uint32_t gen;  // a request's generation
  uint64_t fast;  // the slots this event granted at once (the plan it consumed)
  double time;  // when it happened (the caller's monotonic clock): the daemon applies it then
};

struct ChainStep {  // an expected event and what it grants
  uint32_t slot;
  uint32_t kind;
  uint64_t grants;
};

struct Slot {
  std::atomic<uint32_t> grant_gen;  // the generation of the latest granted request (futex)
  std::atomic<uint32_t> req_gen;  // the generation of the latest request
  std::atomic<int32_t> device;  // -1: free
};

struct Device {
  pthread_mutex_t mu;  // robust, process-shared
  uint64_t head;  // the daemon drained every event before this position
  uint64_t tail;  // the next event's position
  uint64_t plan_seq;  // the plan holds while tail == plan_seq
  uint32_t plan_valid;
  uint32_t concurrent;  // every request is granted at once, whatever came before
  std::atomic<uint32_t> doorbell;  // a wake-up for the daemon is pending
  // Set, never cleared, by a daemon that could not take the mutex for long (a rank
  // stopped inside it): no rank enters again, they all ask over their sockets.
  std::atomic<uint32_t> fenced;
  uint64_t on_request[kMaxSlots];  // grants if this slot requests next
  uint64_t on_release[kMaxSlots];  // grants if this holder releases next (not to idle)
  uint32_t chain_len;
  uint32_t chain_ok;  // every event since plan_seq followed the chain
  ChainStep chain[kChain];
  uint64_t fast_grants;  // statistics: grants made without the daemon
  Event ring[kRing];
};

struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t devices;
  int32_t daemon_pid;
  uint32_t pad;
  Slot slots[kMaxSlots];
  Device dev[kMaxDevices];
};

// A mapped table. The daemon creates it; ranks attach to it by path.
class Table {
 public:
  // Creates (replacing) the file at `path`, mode 0600. Throws std::runtime_error.
  static Table Create(const std::string& path, int devices);
  // Maps an existing table; checks its magic and version. Throws std::runtime_error.
  static Table Attach(const std::string& path);
  Table(Table&& other) noexcept;
  Table& operator=(Table&&) = delete;
  Table(const Table&) = delete;
  ~Table();

  int devices() const { return h_->devices; }
  int daemon_pid() const { return h_->daemon_pid; }

  // --- a rank ------------------------------------------------------------------------
  // Appends a request of `slot` on `dev`; returns flags (kGranted, kRingDaemon) or an
  // error; `*gen` receives the request's generation, to wait for.
  int Request(int dev, int slot, double now, double lock_timeout_s, uint32_t* gen);
  // Appends a release; the plan (made for one phase) runs only when `use_plan`.
  int Release(int dev, int slot, uint32_t phase, bool use_plan, double now,
              double lock_timeout_s);
  // Waits until the request `gen` of `slot` is granted; false on timeout.
  bool WaitGrant(int slot, uint32_t gen, double timeout_s) const;
  bool Granted(int slot, uint32_t gen) const;

  // --- the daemon --------------------------------------------------------------------
  // Takes the events not drained yet (and clears the pending wake-up); invalidates the
  // plan when `invalidate`. Returns false if the mutex stayed busy (try again).
  bool Drain(int dev, std::vector<Event>* out, uint64_t* seq, bool invalidate,
             double lock_timeout_s);
  // Publishes a plan computed after every event up to `seq`; false if events came since.
  bool Publish(int dev, uint64_t seq, const std::vector<uint64_t>& on_request,
               const std::vector<uint64_t>& on_release, const std::vector<ChainStep>& chain,
               bool concurrent, double lock_timeout_s);
  // Grants request `gen` of `slot` (idempotent; never grants a later request).
  void Grant(int slot, uint32_t gen);
  void Bind(int slot, int dev);  // a rank takes the slot
  void Unbind(int slot);  // the rank left
  // Closes the device's ring for good, without its mutex (see Device::fenced), and takes
  // the events committed but not drained yet.
  void Fence(int dev, std::vector<Event>* out);
  uint64_t FastGrants(int dev) const { return h_->dev[dev].fast_grants; }

 private:
  Table(void* base, size_t size) : base_(base), size_(size), h_(static_cast<Header*>(base)) {}
  bool Lock(Device* d, double timeout_s);
  // A rank's call: checks its arguments, takes the device's mutex and makes sure the ring
  // has room; 0 with the mutex held and `*out` set, or the error (mutex not held).
  int Enter(int dev, int slot, double lock_timeout_s, Device** out);
  void Unlock(Device* d);
  // The plan's answer to an event at the tail (mutex held): whether one holds, the
  // grants, and how many chain events are left after it.
  bool Planned(Device* d, uint32_t slot, uint32_t kind, bool use_plan, uint64_t* grants,
               uint32_t* left);
  // Commits `ev` and runs the plan's grants if it holds (mutex held); returns the mask.
  uint64_t Append(Device* d, Event ev, uint64_t plan_mask, bool use_plan);
  // Whether the event should wake the daemon; sets the pending flag if so (mutex held).
  bool Ring(Device* d, bool planned, uint64_t grants, bool handed_on, uint32_t left);
  void Wake(uint64_t mask);

  void* base_;
  size_t size_;
  Header* h_;
};

}  // namespace crossover
