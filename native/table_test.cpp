// The slot table's unit test (run by ctest): plans, grants, the ring, and crash safety.
#include <sys/mman.h>
#include <sys/wait.h>
#include <signal.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "table.hpp"

using namespace crossover;

static int failures = 0;
#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

static std::vector<uint64_t> Masks(int slot, uint64_t mask) {
  std::vector<uint64_t> v(kMaxSlots, 0);
  if (slot >= 0) v[slot] = mask;
  return v;
}

static Header* MapRaw(const std::string& path) {  // the test's own view of the file
  int fd = open(path.c_str(), O_RDWR);
  void* p = mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  return static_cast<Header*>(p);
}

int main() {
  char dir[] = "/tmp/crossover-table-XXXXXX";
  if (mkdtemp(dir) == nullptr) return 2;
  std::string path = std::string(dir) + "/node.slots";
  Table daemon = Table::Create(path, 2);
  Table rank = Table::Attach(path);
  CHECK(rank.devices() == 2);
  CHECK(rank.daemon_pid() == getpid());

  // No plan: a request is queued, and the first event of a round rings the daemon.
  uint32_t g1 = 0, g2 = 0;
  CHECK(rank.Request(0, 1, 0.0, 1.0, &g1) == kRingDaemon);
  CHECK(rank.Request(0, 2, 0.0, 1.0, &g2) == 0);  // a wake-up is pending already
  CHECK(!rank.Granted(1, g1));
  std::vector<Event> ev;
  uint64_t seq = 0;
  CHECK(daemon.Drain(0, &ev, &seq, false, 1.0));
  CHECK(ev.size() == 2 && seq == 2);
  CHECK(ev[0].slot == 1 && ev[0].kind == kRequest && ev[0].gen == g1 && ev[0].fast == 0);
  CHECK(ev[1].slot == 2 && ev[1].gen == g2);

  // The daemon grants slot 1; it plans: when slot 1 releases, grant slot 2.
  daemon.Grant(1, g1);
  CHECK(rank.Granted(1, g1));
  CHECK(daemon.Publish(0, seq, Masks(-1, 0), Masks(1, uint64_t{1} << 2), {}, false, 1.0));
  std::thread waiter([&] { CHECK(rank.WaitGrant(2, g2, 5.0)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  // A release that hands the device on does not wake the daemon (it applies the event
  // with the next one that rings)...
  CHECK(rank.Release(0, 1, 7, true, 0.0, 1.0) == 0);
  waiter.join();
  CHECK(daemon.FastGrants(0) == 1);
  // ...and the plan is consumed: slot 2's release now waits for the daemon, and rings.
  CHECK(rank.Release(0, 2, 7, true, 0.0, 1.0) == kRingDaemon);
  ev.clear();
  CHECK(daemon.Drain(0, &ev, &seq, false, 1.0));
  CHECK(ev.size() == 2 && ev[0].kind == kRelease && ev[0].phase == 7);
  CHECK(ev[0].fast == (uint64_t{1} << 2) && ev[1].fast == 0);

  // A plan made before the latest event is refused.
  uint32_t g3 = 0;
  rank.Request(0, 1, 0.0, 1.0, &g3);
  CHECK(!daemon.Publish(0, seq, Masks(1, 2), Masks(-1, 0), {}, false, 1.0));
  ev.clear();
  CHECK(daemon.Drain(0, &ev, &seq, false, 1.0));
  // A release in a phase the plan was not made for never runs it (an idle rank changes who is in line).
  CHECK(daemon.Publish(0, seq, Masks(-1, 0), Masks(1, uint64_t{1} << 2), {}, false, 1.0));
  rank.Release(0, 1, 3, false, 0.0, 1.0);
  ev.clear();
  CHECK(daemon.Drain(0, &ev, &seq, false, 1.0));
  CHECK(ev.size() == 1 && ev[0].fast == 0);

  // Concurrent mode grants every request at once; grants are idempotent, never ahead.
  CHECK(daemon.Publish(0, seq, Masks(-1, 0), Masks(-1, 0), {}, true, 1.0));
  uint32_t g4 = 0;
  CHECK(rank.Request(0, 3, 0.0, 1.0, &g4) & kGranted);
  daemon.Grant(3, g4 - 1);
  CHECK(rank.Granted(3, g4));
  CHECK(!rank.Granted(3, g4 + 1));
  // Invalidation ends concurrent mode until the daemon publishes again.
  ev.clear();
  CHECK(daemon.Drain(0, &ev, &seq, true, 1.0));
  uint32_t g5 = 0;
  CHECK((rank.Request(0, 3, 0.0, 1.0, &g5) & kGranted) == 0);
  CHECK(!rank.WaitGrant(3, g5, 0.01));  // a wait ends at its timeout

  // A chain: slot 1 holds, slot 2 waits; each releases, asks again, and so on. While
  // the events follow it, each handoff happens without the daemon; one step off it and
  // the plan is gone.
  ev.clear();
  CHECK(daemon.Drain(0, &ev, &seq, true, 1.0));
  uint32_t ga = 0, gb = 0;
  daemon.Grant(1, 0);
  std::vector<ChainStep> chain;
  for (int i = 0; i < 8; ++i) {
    uint32_t holder = i % 2 == 0 ? 1 : 2, next = i % 2 == 0 ? 2 : 1;
    chain.push_back({holder, kRelease, uint64_t{1} << next});
    chain.push_back({holder, kRequest, 0});
  }
  rank.Request(0, 2, 0.0, 1.0, &gb);  // slot 2 waits
  ev.clear();
  CHECK(daemon.Drain(0, &ev, &seq, false, 1.0));
  CHECK(daemon.Publish(0, seq, Masks(-1, 0), Masks(1, uint64_t{1} << 2), chain, false, 1.0));
  CHECK(rank.Release(0, 1, 7, true, 0.0, 1.0) == 0);  // hands on: no ring
  CHECK(rank.Granted(2, gb));
  CHECK(rank.Request(0, 1, 0.0, 1.0, &ga) == 0);  // on the chain, far from its end
  CHECK(!rank.Granted(1, ga));
  CHECK(rank.Release(0, 2, 7, true, 0.0, 1.0) == 0);
  CHECK(rank.Granted(1, ga));
  CHECK(rank.Request(0, 2, 0.0, 1.0, &gb) == 0);
  CHECK(rank.Release(0, 1, 3, false, 0.0, 1.0) == kRingDaemon);  // off the chain: idle
  CHECK(rank.Release(0, 2, 7, true, 0.0, 1.0) == 0);  // (rang already)
  CHECK(!rank.Granted(2, gb + 1));
  ev.clear();
  CHECK(daemon.Drain(0, &ev, &seq, false, 1.0));
  CHECK(ev.size() == 6 && ev[0].fast == (uint64_t{1} << 2) && ev[2].fast == (uint64_t{1} << 1));
  CHECK(ev[4].fast == 0 && ev[5].fast == 0);

  // A full ring is refused, not overwritten.
  int full = 0;
  for (uint64_t i = 0; i <= kRing; ++i) full = rank.Release(1, 4, 7, false, 0.0, 1.0);
  CHECK(full == kRingFull);
  ev.clear();
  CHECK(daemon.Drain(1, &ev, &seq, false, 1.0) && ev.size() == kRing);

  // A rank that dies inside the mutex leaves it recoverable (robust mutex).
  Header* raw = MapRaw(path);
  pid_t child = fork();
  if (child == 0) {
    pthread_mutex_lock(&raw->dev[0].mu);
    _exit(0);
  }
  waitpid(child, nullptr, 0);
  uint32_t g6 = 0;
  CHECK(rank.Request(0, 5, 0.0, 1.0, &g6) >= 0);
  // A live holder of the mutex (a stopped rank) makes callers time out, not hang.
  child = fork();
  if (child == 0) {
    pthread_mutex_lock(&raw->dev[1].mu);
    sleep(5);
    _exit(0);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto t0 = std::chrono::steady_clock::now();
  uint32_t g7 = 0;
  CHECK(rank.Request(1, 5, 0.0, 0.05, &g7) == kLockTimeout);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  CHECK(rank.Request(1, 5, 0.0, 1.0, &g7) >= 0);

  // A chain length written past its array (the table is writable shared memory) is
  // clamped: a chain of kChain events ends there, and its last events ring the daemon
  // to plan on (unclamped, `left` would stay huge and none would).
  ev.clear();
  CHECK(daemon.Drain(0, &ev, &seq, true, 1.0));
  std::vector<ChainStep> releases(kChain, ChainStep{5, kRelease, 0});
  CHECK(daemon.Publish(0, seq, Masks(-1, 0), Masks(-1, 0), releases, false, 1.0));
  raw->dev[0].chain_len = 0xFFFFFFFFu;
  int rang = 0;
  for (uint32_t i = 0; i < kChain; ++i) {
    int flags = rank.Release(0, 5, 7, true, 0.0, 1.0);
    CHECK(flags >= 0);
    rang += (flags & kRingDaemon) ? 1 : 0;
  }
  CHECK(rang == 1);
  ev.clear();
  CHECK(daemon.Drain(0, &ev, &seq, false, 1.0));

  // A fenced device takes no event again, even with its mutex stuck, so its ranks go to
  // their sockets; the other device is untouched.
  CHECK(rank.Release(0, 5, 7, false, 0.0, 1.0) >= 0);  // committed, not drained
  child = fork();
  if (child == 0) {
    pthread_mutex_lock(&raw->dev[0].mu);
    sleep(5);
    _exit(0);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::vector<Event> left;
  daemon.Fence(0, &left);
  CHECK(left.size() == 1 && left[0].slot == 5 && left[0].kind == kRelease);
  t0 = std::chrono::steady_clock::now();
  CHECK(rank.Request(0, 5, 0.0, 1.0, &g7) == kFenced);
  CHECK(rank.Release(0, 5, 7, true, 0.0, 1.0) == kFenced);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(100));
  CHECK(rank.Request(1, 5, 0.0, 1.0, &g7) >= 0);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);

  // Bad arguments are refused; a table of another layout is not attached.
  CHECK(rank.Request(9, 0, 0.0, 1.0, &g7) == kBadArgument);
  CHECK(rank.Release(0, kMaxSlots, 7, false, 0.0, 1.0) == kBadArgument);
  std::string junk = std::string(dir) + "/junk";
  FILE* f = std::fopen(junk.c_str(), "w");
  std::fputs("not a table", f);
  std::fclose(f);
  bool threw = false;
  try {
    Table::Attach(junk);
  } catch (const std::runtime_error&) {
    threw = true;
  }
  CHECK(threw);

  munmap(raw, sizeof(Header));
  unlink(junk.c_str());
  unlink(path.c_str());
  rmdir(dir);
  if (failures == 0) std::printf("table_test: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
