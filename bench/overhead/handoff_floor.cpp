// The machine's floor for a handoff between two processes: a futex ping-pong with no
// Python, no table and no daemon. bench/handoff_bench.py builds and runs it beside the
// real paths, so their latencies can be read against what the kernel allows here.
//
//   handoff_floor HOLD_US HANDOFFS  ->  one JSON line: {"p50_us": .., "p99_us": ..}
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>

static double NowUs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s HOLD_US HANDOFFS\n", argv[0]);
    return 2;
  }
  double hold_us = std::atof(argv[1]);
  int handoffs = std::atoi(argv[2]);
  void* mem = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  auto* turn = static_cast<std::atomic<uint32_t>*>(mem);
  auto* released_at = reinterpret_cast<std::atomic<double>*>(static_cast<char*>(mem) + 64);
  int pipefd[2];
  if (pipe(pipefd) != 0) return 2;
  pid_t child = fork();
  int me = child == 0 ? 1 : 0;
  std::vector<double> lat;
  for (int i = me; i < handoffs; i += 2) {
    for (uint32_t cur; (cur = turn->load()) != uint32_t(i);) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(turn), FUTEX_WAIT, cur, nullptr, nullptr, 0);
    }
    if (i > 0) lat.push_back(NowUs() - released_at->load());
    for (double end = NowUs() + hold_us; NowUs() < end;) {
    }
    released_at->store(NowUs());
    turn->store(uint32_t(i + 1));
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(turn), FUTEX_WAKE, 1, nullptr, nullptr, 0);
  }
  if (child == 0) {  // hand the child's latencies to the parent
    size_t n = lat.size();
    if (write(pipefd[1], &n, sizeof n) < 0 || write(pipefd[1], lat.data(), n * sizeof(double)) < 0) _exit(1);
    _exit(0);
  }
  size_t n = 0;
  if (read(pipefd[0], &n, sizeof n) != sizeof n) return 1;
  std::vector<double> theirs(n);
  size_t want = n * sizeof(double), got = 0;
  while (got < want) {
    ssize_t r = read(pipefd[0], reinterpret_cast<char*>(theirs.data()) + got, want - got);
    if (r <= 0) return 1;
    got += size_t(r);
  }
  waitpid(child, nullptr, 0);
  lat.insert(lat.end(), theirs.begin(), theirs.end());
  std::sort(lat.begin(), lat.end());
  std::printf("{\"p50_us\": %.2f, \"p99_us\": %.2f, \"max_us\": %.2f}\n", lat[lat.size() / 2],
              lat[lat.size() * 99 / 100], lat.back());
  return 0;
}
