// crossover._native: the slot table (table.hpp) for Python. Calls that may block release
// the GIL, so a rank's other threads (Horovod's background loop) run while it waits.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>

#include "table.hpp"

namespace py = pybind11;
using crossover::Event;
using crossover::Table;

PYBIND11_MODULE(_native, m) {
  m.doc() = "Crossover's node-local slot table: the daemon's fast path (see native/table.hpp)";
  m.attr("MAX_SLOTS") = crossover::kMaxSlots;
  m.attr("MAX_DEVICES") = crossover::kMaxDevices;
  m.attr("RING") = crossover::kRing;
  m.attr("WAKE") = crossover::kWake;
  m.attr("CHAIN") = crossover::kChain;
  m.attr("GRANTED") = crossover::kGranted;
  m.attr("RING_DAEMON") = crossover::kRingDaemon;
  m.attr("LOCK_TIMEOUT") = crossover::kLockTimeout;
  m.attr("RING_FULL") = crossover::kRingFull;
  m.attr("BAD_ARGUMENT") = crossover::kBadArgument;
  m.attr("FENCED") = crossover::kFenced;
  // Where device i's record (its mutex first) lies in the file: offset + i * size. For
  // tools and tests that look at a live table from outside.
  m.attr("DEVICE_OFFSET") = offsetof(crossover::Header, dev);
  m.attr("DEVICE_SIZE") = sizeof(crossover::Device);
  m.attr("REQUEST") = static_cast<int>(crossover::kRequest);
  m.attr("RELEASE") = static_cast<int>(crossover::kRelease);

  py::class_<Table>(m, "Table")
      .def_static("create", &Table::Create, py::arg("path"), py::arg("devices"),
                  "Create (replacing) a table file, mode 0600 (the daemon).")
      .def_static("attach", &Table::Attach, py::arg("path"), "Map an existing table (a rank).")
      .def_property_readonly("devices", &Table::devices)
      .def_property_readonly("daemon_pid", &Table::daemon_pid)
      .def(
          "request",
          [](Table& t, int dev, int slot, double now, double lock_timeout_s) {
            uint32_t gen = 0;
            int flags;
            {
              py::gil_scoped_release nogil;
              flags = t.Request(dev, slot, now, lock_timeout_s, &gen);
            }
            return py::make_tuple(flags, gen);
          },
          py::arg("dev"), py::arg("slot"), py::arg("now"), py::arg("lock_timeout_s"),
          "Append a request made at `now`; returns (flags or error, generation).")
      .def("release", &Table::Release, py::arg("dev"), py::arg("slot"), py::arg("phase"),
           py::arg("use_plan"), py::arg("now"),
           py::arg("lock_timeout_s"), py::call_guard<py::gil_scoped_release>(),
           "Append a release; returns flags or an error.")
      .def("wait_grant", &Table::WaitGrant, py::arg("slot"), py::arg("gen"),
           py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
           "Wait until request `gen` of `slot` is granted; False on timeout.")
      .def("granted", &Table::Granted, py::arg("slot"), py::arg("gen"))
      .def(
          "drain",
          [](Table& t, int dev, bool invalidate, double lock_timeout_s) -> py::object {
            std::vector<Event> events;
            uint64_t seq = 0;
            bool ok;
            {
              py::gil_scoped_release nogil;
              ok = t.Drain(dev, &events, &seq, invalidate, lock_timeout_s);
            }
            if (!ok) return py::none();
            py::list out;
            for (const Event& e : events) {
              out.append(py::make_tuple(e.slot, e.kind, e.phase, e.gen, e.fast, e.time));
            }
            return py::make_tuple(seq, out);
          },
          py::arg("dev"), py::arg("invalidate"), py::arg("lock_timeout_s"),
          "Take the undrained events: (seq, [(slot, kind, phase, gen, fast, time)]), or None "
          "if the device's mutex stayed busy.")
      .def(
          "publish",
          [](Table& t, int dev, uint64_t seq, const std::vector<uint64_t>& on_request,
             const std::vector<uint64_t>& on_release,
             const std::vector<std::tuple<uint32_t, uint32_t, uint64_t>>& chain,
             bool concurrent, double lock_timeout_s) {
            std::vector<crossover::ChainStep> steps;
            for (const auto& [slot, kind, grants] : chain) steps.push_back({slot, kind, grants});
            py::gil_scoped_release nogil;
            return t.Publish(dev, seq, on_request, on_release, steps, concurrent,
                             lock_timeout_s);
          },
          py::arg("dev"), py::arg("seq"), py::arg("on_request"), py::arg("on_release"),
          py::arg("chain"), py::arg("concurrent"), py::arg("lock_timeout_s"),
          "Publish the plan made after event `seq` (chain: [(slot, kind, grants)]); False "
          "if events came since.")
      .def("grant", &Table::Grant, py::arg("slot"), py::arg("gen"))
      .def("bind", &Table::Bind, py::arg("slot"), py::arg("dev"))
      .def("unbind", &Table::Unbind, py::arg("slot"))
      .def(
          "fence",
          [](Table& t, int dev) {
            std::vector<Event> events;
            t.Fence(dev, &events);
            py::list out;
            for (const Event& e : events) {
              out.append(py::make_tuple(e.slot, e.kind, e.phase, e.gen, e.fast, e.time));
            }
            return out;
          },
          py::arg("dev"),
          "Close the device's ring for good (its ranks ask over their sockets); returns "
          "the events not drained yet, as drain does.")
      .def("fast_grants", &Table::FastGrants, py::arg("dev"));
}
