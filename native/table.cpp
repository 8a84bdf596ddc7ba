// The node-local slot table (see table.hpp for the design).
#include "table.hpp"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace crossover {
namespace {

std::runtime_error SysError(const std::string& what, const std::string& path) {
  return std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

timespec Deadline(double seconds) {  // monotonic: a clock step never stretches a wait
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  auto ns = static_cast<long long>(seconds * 1e9) + ts.tv_nsec;
  ts.tv_sec += ns / 1000000000LL;
  ts.tv_nsec = ns % 1000000000LL;
  return ts;
}

double Now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Shared (not private) futexes: the waiters are other processes.
long Futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, timeout, nullptr, 0);
}

bool Reached(uint32_t value, uint32_t gen) {  // generations wrap: compare by difference
  return static_cast<int32_t>(value - gen) >= 0;
}

constexpr uint64_t Bit(int slot) { return uint64_t{1} << slot; }

}  // namespace

Table Table::Create(const std::string& path, int devices) {
  if (devices < 1 || devices > kMaxDevices) {
    throw std::invalid_argument("a slot table holds 1 to " + std::to_string(kMaxDevices) +
                                " devices, not " + std::to_string(devices));
  }
  // A new file replaces any old one: a killed daemon's table never carries over.
  std::string tmp = path + ".new";
  ::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw SysError("cannot create the slot table", tmp);
  size_t size = sizeof(Header);
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    ::close(fd);
    throw SysError("cannot size the slot table", tmp);
  }
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) throw SysError("cannot map the slot table", tmp);
  auto* h = static_cast<Header*>(base);  // the file is zero-filled
  h->version = kVersion;
  h->devices = static_cast<uint32_t>(devices);
  h->daemon_pid = ::getpid();
  for (auto& s : h->slots) s.device.store(-1);
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  for (int i = 0; i < devices; ++i) pthread_mutex_init(&h->dev[i].mu, &attr);
  pthread_mutexattr_destroy(&attr);
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;  // last: an attacher never sees a half-made table
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::munmap(base, size);
    throw SysError("cannot publish the slot table", path);
  }
  return Table(base, size);
}

Table Table::Attach(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) throw SysError("cannot open the slot table", path);
  struct stat st;
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != sizeof(Header)) {
    ::close(fd);
    throw std::runtime_error("the slot table " + path + " has the wrong size (another "
                             "crossover version?): restart the daemon");
  }
  void* base = ::mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) throw SysError("cannot map the slot table", path);
  auto* h = static_cast<Header*>(base);
  if (h->magic != kMagic || h->version != kVersion || h->devices < 1 ||
      h->devices > static_cast<uint32_t>(kMaxDevices)) {
    ::munmap(base, sizeof(Header));
    throw std::runtime_error("the slot table " + path + " is not a version " +
                             std::to_string(kVersion) + " table: restart the daemon");
  }
  return Table(base, sizeof(Header));
}

Table::Table(Table&& other) noexcept : base_(other.base_), size_(other.size_), h_(other.h_) {
  other.base_ = nullptr;
  other.h_ = nullptr;
}

Table::~Table() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

bool Table::Lock(Device* d, double timeout_s) {
  timespec deadline = Deadline(timeout_s);
  int rc = pthread_mutex_clocklock(&d->mu, CLOCK_MONOTONIC, &deadline);
  if (rc == EOWNERDEAD) {
    // Its holder died inside. Every change under the mutex is committed by the tail's
    // increment, after the event is whole, so the state is consistent as it is.
    pthread_mutex_consistent(&d->mu);
    return true;
  }
  return rc == 0;
}

void Table::Unlock(Device* d) { pthread_mutex_unlock(&d->mu); }

uint64_t Table::Append(Device* d, Event ev, uint64_t plan_mask, bool use_plan) {
  ev.fast = use_plan ? plan_mask & ~kWake : 0;
  d->ring[d->tail % kRing] = ev;
  // Committed: the daemon will apply it, whatever happens next. Released, so that a
  // daemon reading the ring without the mutex (`Fence`) sees the event whole.
  __atomic_store_n(&d->tail, d->tail + 1, __ATOMIC_RELEASE);
  for (int s = 0; s < kMaxSlots; ++s) {
    if (ev.fast & Bit(s)) {
      // A waiting rank's latest request is the one the plan grants.
      h_->slots[s].grant_gen.store(h_->slots[s].req_gen.load(std::memory_order_relaxed),
                                   std::memory_order_release);
    }
  }
  d->fast_grants += static_cast<uint64_t>(__builtin_popcountll(ev.fast));
  return ev.fast;
}

void Table::Wake(uint64_t mask) {
  for (int s = 0; s < kMaxSlots; ++s) {
    if (mask & Bit(s)) Futex(&h_->slots[s].grant_gen, FUTEX_WAKE, INT32_MAX, nullptr);
  }
}

bool Table::Planned(Device* d, uint32_t slot, uint32_t kind, bool use_plan,
                    uint64_t* grants, uint32_t* left) {
  *grants = 0;
  *left = 0;
  if (!d->plan_valid || d->tail < d->plan_seq) return false;
  uint64_t pos = d->tail - d->plan_seq;
  // The table is shared memory any process of the user can write: never trust a length.
  uint32_t chain_len = d->chain_len < kChain ? d->chain_len : kChain;
  bool follows = use_plan && d->chain_ok && pos < chain_len &&
                 d->chain[pos].slot == slot && d->chain[pos].kind == kind;
  d->chain_ok = follows;  // once off the chain, stay off until the next plan
  if (!use_plan) return false;
  if (follows) *left = chain_len - uint32_t(pos) - 1;
  if (pos == 0) {  // any slot's next event: its own answer
    *grants = kind == kRequest ? d->on_request[slot] : d->on_release[slot];
    return true;
  }
  if (follows) *grants = d->chain[pos].grants;
  return follows;
}

bool Table::Ring(Device* d, bool planned, uint64_t grants, bool handed_on, uint32_t left) {
  // A planned event needs no decision; the daemon is woken when the chain runs short
  // (to plan the next one in time), but not by a release that handed the device on: the
  // rank just granted should not compete with it for a core. The flag is set only when
  // ringing, so the next event that wants the daemon rings.
  bool want = !planned || (grants & kWake) || (left <= kRefill && !handed_on);
  return want && d->doorbell.exchange(1) == 0;
}

int Table::Enter(int dev, int slot, double lock_timeout_s, Device** out) {
  if (dev < 0 || dev >= devices() || slot < 0 || slot >= kMaxSlots) return kBadArgument;
  Device* d = &h_->dev[dev];
  if (d->fenced.load(std::memory_order_acquire)) return kFenced;
  if (!Lock(d, lock_timeout_s)) return kLockTimeout;
  if (d->tail - d->head >= kRing) {
    Unlock(d);
    return kRingFull;
  }
  *out = d;
  return 0;
}

int Table::Request(int dev, int slot, double now, double lock_timeout_s, uint32_t* gen) {
  Device* d = nullptr;
  if (int err = Enter(dev, slot, lock_timeout_s, &d)) return err;
  Slot& s = h_->slots[slot];
  uint32_t g = s.req_gen.load(std::memory_order_relaxed) + 1;
  s.req_gen.store(g, std::memory_order_relaxed);
  *gen = g;
  uint64_t grants = Bit(slot);
  uint32_t left = 0;
  // The scheduler grants every request at once in concurrent mode.
  bool planned = d->concurrent || Planned(d, uint32_t(slot), kRequest, true, &grants, &left);
  uint64_t fast = Append(d, Event{uint32_t(slot), kRequest, 0, g, 0, now}, grants, planned);
  int flags = (fast & Bit(slot)) ? kGranted : 0;
  if (Ring(d, planned, grants, false, left)) flags |= kRingDaemon;
  Unlock(d);
  Wake(fast & ~Bit(slot));
  return flags;
}

int Table::Release(int dev, int slot, uint32_t phase, bool use_plan, double now,
                   double lock_timeout_s) {
  Device* d = nullptr;
  if (int err = Enter(dev, slot, lock_timeout_s, &d)) return err;
  // In concurrent mode nobody waits, so a release grants nothing. The plan is made for
  // one phase (an idle rank, say, is not waited for: it changes who is in line).
  uint64_t grants = 0;
  uint32_t left = 0;
  bool planned = d->concurrent ||
                 Planned(d, uint32_t(slot), kRelease, use_plan, &grants, &left);
  uint64_t fast = Append(d, Event{uint32_t(slot), kRelease, phase, 0, 0, now}, grants, planned);
  int flags = Ring(d, planned, grants, fast != 0, left) ? kRingDaemon : 0;
  Unlock(d);
  Wake(fast);
  return flags;
}

bool Table::Granted(int slot, uint32_t gen) const {
  if (slot < 0 || slot >= kMaxSlots) return false;
  return Reached(h_->slots[slot].grant_gen.load(std::memory_order_acquire), gen);
}

bool Table::WaitGrant(int slot, uint32_t gen, double timeout_s) const {
  if (slot < 0 || slot >= kMaxSlots) return false;
  auto* word = &h_->slots[slot].grant_gen;
  double end = Now() + timeout_s;
  for (;;) {
    uint32_t cur = word->load(std::memory_order_acquire);
    if (Reached(cur, gen)) return true;
    double left = end - Now();
    if (left <= 0) return false;
    timespec ts{static_cast<time_t>(left), static_cast<long>((left - (time_t)left) * 1e9)};
    Futex(word, FUTEX_WAIT, cur, &ts);  // returns at once if the word moved already
  }
}

bool Table::Drain(int dev, std::vector<Event>* out, uint64_t* seq, bool invalidate,
                  double lock_timeout_s) {
  if (dev < 0 || dev >= devices()) return false;
  Device* d = &h_->dev[dev];
  if (!Lock(d, lock_timeout_s)) return false;
  d->doorbell.store(0);
  for (uint64_t i = d->head; i < d->tail; ++i) out->push_back(d->ring[i % kRing]);
  d->head = d->tail;
  *seq = d->tail;
  if (invalidate) {
    d->plan_valid = 0;
    d->concurrent = 0;
    d->chain_ok = 0;
  }
  Unlock(d);
  return true;
}

bool Table::Publish(int dev, uint64_t seq, const std::vector<uint64_t>& on_request,
                    const std::vector<uint64_t>& on_release,
                    const std::vector<ChainStep>& chain, bool concurrent,
                    double lock_timeout_s) {
  if (dev < 0 || dev >= devices() || on_request.size() != kMaxSlots ||
      on_release.size() != kMaxSlots || chain.size() > kChain) {
    return false;
  }
  Device* d = &h_->dev[dev];
  if (!Lock(d, lock_timeout_s)) return false;
  bool current = d->tail == seq;
  if (current) {
    std::memcpy(d->on_request, on_request.data(), sizeof(d->on_request));
    std::memcpy(d->on_release, on_release.data(), sizeof(d->on_release));
    for (size_t i = 0; i < chain.size(); ++i) d->chain[i] = chain[i];
    // (concurrent mode grants every request whatever came before: no chain needed)
    d->chain_len = concurrent ? 0 : uint32_t(chain.size());
    d->chain_ok = 1;
    d->plan_seq = seq;
    d->plan_valid = 1;
    d->concurrent = concurrent ? 1 : 0;
  }
  Unlock(d);
  return current;
}

void Table::Grant(int slot, uint32_t gen) {
  if (slot < 0 || slot >= kMaxSlots) return;
  auto& word = h_->slots[slot].grant_gen;
  uint32_t cur = word.load(std::memory_order_relaxed);
  // Raise the word to `gen`, never lower it (a plan may have granted it already).
  while (!Reached(cur, gen) &&
         !word.compare_exchange_weak(cur, gen, std::memory_order_release)) {
  }
  Futex(&word, FUTEX_WAKE, INT32_MAX, nullptr);
}

void Table::Bind(int slot, int dev) {
  if (slot < 0 || slot >= kMaxSlots) return;
  h_->slots[slot].device.store(dev);
}

void Table::Fence(int dev, std::vector<Event>* out) {
  if (dev < 0 || dev >= devices()) return;
  Device* d = &h_->dev[dev];
  d->fenced.store(1, std::memory_order_seq_cst);
  // No rank enters from now on (the one stopped inside may still commit its event: that
  // one is never applied). The plan is withdrawn without the mutex, and the events
  // committed before are read without it: the tail moves only once an event is whole.
  d->plan_valid = 0;
  d->concurrent = 0;
  d->chain_ok = 0;
  uint64_t tail = __atomic_load_n(&d->tail, __ATOMIC_ACQUIRE);
  uint64_t head = d->head + (tail - d->head > kRing ? tail - d->head - kRing : 0);
  for (uint64_t i = head; i < tail; ++i) out->push_back(d->ring[i % kRing]);
  d->head = tail;
}

void Table::Unbind(int slot) {
  if (slot < 0 || slot >= kMaxSlots) return;
  h_->slots[slot].device.store(-1);
}

}  // namespace crossover
