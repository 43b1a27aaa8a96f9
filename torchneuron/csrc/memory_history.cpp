// Allocation history and memory snapshots in PyTorch's format (torch.cuda.memory._snapshot), which PyTorch's
// visualizer (torch.cuda._memory_viz, pytorch.org/memory_viz) renders: the allocator's segments and blocks with
// the stack that allocated each block, and per device the trace of alloc / free / segment / oom events.
// Stacks are PyTorch's CapturedTraceback (Python frames; C++ frames too with stacks="all").
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/extension.h>

#include <deque>
#include <mutex>
#include <unordered_map>

#include "runtime.h"

// Exported by libtorch_python; their header (torch/csrc/profiler/python/combined_traceback.h) needs nlohmann/json,
// which the wheel does not ship.
namespace torch {
std::vector<pybind11::object> py_symbolize(std::vector<CapturedTraceback*>& to_symbolize);
void installCapturedTracebackPython();
}  // namespace torch

namespace torchneuron {

std::atomic<bool> g_recording_memory{false};

namespace {

constexpr const char* kActionNames[] = {"alloc",         "free_requested", "free_completed",
                                        "segment_alloc", "segment_free",   "oom"};
constexpr size_t kSmall = 1 << 20;  // the allocator's small-pool bound

struct TraceEntry {
  MemoryAction action;
  c10::DeviceIndex device;
  uintptr_t addr;
  size_t size, device_free;
  int64_t time_us;
  std::shared_ptr<c10::GatheredContext> context;
};

struct Settings {
  bool history = false;        // enabled="all": keep the trace of events
  bool state_context = false;  // context != None: stacks of live blocks
  bool alloc_context = false;  // context in ("alloc", "all"): stacks on alloc events
  bool free_context = false;   // context == "all": stacks on free events
  bool cpp = false;            // stacks == "all"
  size_t max_entries = SIZE_MAX;
  bool skip[6] = {};
};

std::mutex g_mu;  // taken inside the allocator's lock, never around it
Settings g_settings;
std::deque<TraceEntry> g_trace;
std::unordered_map<uintptr_t, std::shared_ptr<c10::GatheredContext>> g_block_context;  // live blocks' stacks

bool is_free(MemoryAction a) { return a == MemoryAction::free_requested || a == MemoryAction::free_completed; }

torch::CapturedTraceback* traceback(const std::shared_ptr<c10::GatheredContext>& ctx) {
  return static_cast<torch::CapturedTraceback*>(ctx.get());
}

}  // namespace

std::shared_ptr<c10::GatheredContext> memory_context(MemoryAction action) {
  if (!g_recording_memory.load(std::memory_order_relaxed)) return nullptr;
  bool want, cpp;
  {
    std::lock_guard<std::mutex> g(g_mu);
    want = is_free(action) ? g_settings.free_context : g_settings.state_context;
    cpp = g_settings.cpp;
  }
  return want ? torch::CapturedTraceback::gather(/*python=*/true, /*script=*/true, cpp) : nullptr;
}

void record_memory_event(MemoryAction action, c10::DeviceIndex device, uintptr_t addr, size_t size,
                         const std::shared_ptr<c10::GatheredContext>& context, size_t device_free) {
  std::lock_guard<std::mutex> g(g_mu);
  const Settings& s = g_settings;
  if (action == MemoryAction::alloc && context) g_block_context[addr] = context;
  if (action == MemoryAction::free_completed || action == MemoryAction::segment_free) g_block_context.erase(addr);
  if (!s.history || s.skip[static_cast<int>(action)] || s.max_entries == 0) return;
  bool keep_stack = is_free(action) ? s.free_context : s.alloc_context;
  g_trace.push_back({action, device, addr, size, device_free, c10::getTime() / 1000, keep_stack ? context : nullptr});
  while (g_trace.size() > s.max_entries) g_trace.pop_front();
}

namespace {

void record_history(std::optional<std::string> enabled, std::optional<std::string> context, const std::string& stacks,
                    size_t max_entries, bool clear_history, const std::vector<std::string>& skip_actions) {
  TORCH_CHECK(!enabled || *enabled == "state" || *enabled == "all", "enabled must be None, 'state' or 'all', got '",
              *enabled, "'");
  TORCH_CHECK(!context || *context == "state" || *context == "alloc" || *context == "all",
              "context must be None, 'state', 'alloc' or 'all', got '", *context, "'");
  TORCH_CHECK(stacks == "python" || stacks == "all", "stacks must be 'python' or 'all', got '", stacks, "'");
  Settings s;
  for (const auto& a : skip_actions) {
    auto it = std::find_if(std::begin(kActionNames), std::end(kActionNames), [&](const char* n) { return a == n; });
    TORCH_CHECK(it != std::end(kActionNames) || a == "snapshot", "skip_actions: unknown action '", a,
                "' (expected alloc, free_requested, free_completed, segment_alloc, segment_free, oom, snapshot)");
    if (it != std::end(kActionNames)) s.skip[it - std::begin(kActionNames)] = true;
  }
  if (enabled) {
    torch::installCapturedTracebackPython();
    s.history = *enabled == "all";
    s.state_context = context.has_value();
    s.alloc_context = context && (*context == "alloc" || *context == "all");
    s.free_context = context && *context == "all";
    s.cpp = stacks == "all";
    s.max_entries = max_entries;
  }
  std::vector<std::shared_ptr<c10::GatheredContext>> dead;  // released after the lock (they may take the GIL)
  {
    std::lock_guard<std::mutex> g(g_mu);
    g_settings = s;
    if (!enabled || clear_history) {
      for (auto& e : g_trace) dead.push_back(std::move(e.context));
      g_trace.clear();
    }
    if (!enabled) {
      for (auto& [a, c] : g_block_context) dead.push_back(std::move(c));
      g_block_context.clear();
    }
  }
  g_recording_memory = enabled.has_value();
}

// torch.cuda.memory._snapshot()'s dictionary for the neuron allocator.
py::dict snapshot() {
  auto blocks = allocator_blocks();
  std::vector<TraceEntry> trace;
  std::vector<std::shared_ptr<c10::GatheredContext>> block_ctx;
  {
    std::lock_guard<std::mutex> g(g_mu);
    trace.assign(g_trace.begin(), g_trace.end());
    for (const auto& b : blocks) {
      auto it = b.in_use ? g_block_context.find(b.address) : g_block_context.end();
      block_ctx.push_back(it == g_block_context.end() ? nullptr : it->second);
    }
  }
  // Symbolize every stack in one batch.
  std::vector<torch::CapturedTraceback*> to_symbolize;
  for (const auto& c : block_ctx)
    if (c) to_symbolize.push_back(traceback(c));
  for (const auto& e : trace)
    if (e.context) to_symbolize.push_back(traceback(e.context));
  std::vector<py::object> frames = torch::py_symbolize(to_symbolize);
  size_t next = 0;
  auto frames_of = [&](const std::shared_ptr<c10::GatheredContext>& c) -> py::object {
    return c ? frames.at(next++) : py::list();
  };

  py::list segments;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const auto& b = blocks[i];
    py::object f = frames_of(block_ctx[i]);
    py::dict block;
    block["address"] = b.address;
    block["size"] = b.size;
    block["requested_size"] = b.in_use ? b.requested : 0;
    block["state"] = b.in_use ? "active_allocated" : "inactive";
    block["frames"] = f;
    py::dict seg;
    seg["device"] = static_cast<int>(b.device);
    seg["address"] = b.address;
    seg["total_size"] = b.size;
    seg["allocated_size"] = b.in_use ? b.size : 0;
    seg["active_size"] = b.in_use ? b.size : 0;
    seg["requested_size"] = b.in_use ? b.requested : 0;
    seg["stream"] = 0;
    seg["segment_type"] = b.size <= kSmall ? "small" : "large";
    seg["segment_pool_id"] = py::make_tuple(0, 0);
    seg["is_expandable"] = false;
    seg["frames"] = f;
    py::list bl;
    bl.append(block);
    seg["blocks"] = bl;
    segments.append(seg);
  }
  py::list device_traces;
  for (c10::DeviceIndex d = 0; d < device_count(); ++d) device_traces.append(py::list());
  for (const auto& e : trace) {
    py::dict t;
    t["action"] = kActionNames[static_cast<int>(e.action)];
    t["addr"] = e.addr;
    t["size"] = e.size;
    t["stream"] = 0;
    t["time_us"] = e.time_us;
    t["frames"] = frames_of(e.context);
    if (e.action == MemoryAction::oom) t["device_free"] = e.device_free;
    if (e.device >= 0 && e.device < device_count()) device_traces[e.device].cast<py::list>().append(t);
  }
  py::dict out;
  out["segments"] = segments;
  out["device_traces"] = device_traces;
  py::dict settings;
  settings["allocator"] = "neuron (caching; one block per segment)";
  out["allocator_settings"] = settings;
  return out;
}

}  // namespace

void bind_memory_history(py::module_& m) {
  m.def("_record_memory_history", &record_history, py::arg("enabled"), py::arg("context"), py::arg("stacks"),
        py::arg("max_entries"), py::arg("clear_history"), py::arg("skip_actions"));
  m.def("_memory_snapshot", &snapshot);
  m.def("_set_memory_fraction",
        [](double f, int device) { set_memory_fraction(static_cast<c10::DeviceIndex>(device), f); });
  m.def("_get_memory_fraction", [](int device) { return memory_fraction(static_cast<c10::DeviceIndex>(device)); });
}

}  // namespace torchneuron
