// torch.profiler's device track for neuron (ProfilerActivity.PrivateUse1): a Kineto activity profiler registered
// through PyTorch's PrivateUse1 profiler registry. While a trace records, every kernel the device executes (an op
// through the boxed fallback or an explicit kernel, or a compiled kernel) is kept with its host times, the
// correlation id of the host op that launched it and its tensors' shapes and dtypes. When the trace is
// collected, the cost model gives each kernel its modelled device time (torchneuron.profiler.kineto, called once
// for the whole trace) and the kernels become CONCURRENT_KERNEL activities on the device's track: one queue per
// device (a kernel starts when it is issued and the previous one has finished), one row per engine, each linked
// to its host op (key_averages() adds their time to that op's device time).
#define FMT_HEADER_ONLY 1  // kineto's headers format metadata with fmt, which libtorch does not export
#define USE_KINETO 1
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>
#undef USE_KINETO

#include <ThreadUtil.h>
#include <c10/util/ApproximateClock.h>
#include <libkineto.h>
#include <output_base.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/extension.h>

#include <map>
#include <mutex>

#include "runtime.h"

namespace torchneuron {

std::atomic<bool> g_tracing_device{false};

struct KernelRecord {
  std::string name;
  bool view = false;
  c10::DeviceIndex device = 0;
  uint64_t correlation = 0;
  int64_t start_ns = 0, end_ns = 0;
  std::vector<std::pair<std::vector<int64_t>, c10::ScalarType>> inputs, outputs;  // (shape, dtype)
  double device_s = -1;  // preset by the caller (compiled kernels), else costed at collection
  int row = 0;
  std::string row_name;
};

namespace {

std::mutex g_mu;
std::vector<KernelRecord> g_records;
thread_local std::vector<uint64_t> t_correlation;  // the host ops (and record_function scopes) open on this thread
py::object* g_coster = nullptr;  // torchneuron.profiler.kineto.cost; never freed (it would outlive the interpreter)

using Specs = std::vector<std::pair<std::vector<int64_t>, c10::ScalarType>>;

void add_tensors(const c10::IValue& v, Specs& out) {
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) out.emplace_back(t.sizes().vec(), t.scalar_type());
  };
  if (v.isTensor())
    add(v.toTensor());
  else if (v.isTensorList())
    for (const auto& t : v.toTensorList()) add(t);
  else if (v.isList())
    for (const auto& e : v.toListRef())
      if (e.isTensor()) add(e.toTensor());
}

void push(KernelRecord&& r) {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_tracing_device.load()) g_records.push_back(std::move(r));
}

class Session final : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    {
      std::lock_guard<std::mutex> g(g_mu);
      g_records.clear();
    }
    start_ns_ = c10::getTime();
    g_tracing_device = true;
    status_ = libkineto::TraceStatus::RECORDING;
  }

  void stop() override {
    g_tracing_device = false;
    end_ns_ = c10::getTime();
    status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override { return errors_; }

  void processTrace(libkineto::ActivityLogger& logger) override {
    buffer_.span = libkineto::TraceSpan(start_ns_, end_ns_, "neuron");
    std::vector<KernelRecord> recs;
    {
      std::lock_guard<std::mutex> g(g_mu);
      recs.swap(g_records);
    }
    cost(recs);
    std::map<c10::DeviceIndex, int64_t> queue_end;
    for (auto& r : recs) {
      buffer_.emplace_activity(buffer_.span, libkineto::ActivityType::CONCURRENT_KERNEL, r.name);
      auto& a = *buffer_.activities.back();
      int64_t& free_at = queue_end[r.device];
      a.startTime = std::max(r.start_ns, free_at);
      a.endTime = a.startTime + static_cast<int64_t>(r.device_s * 1e9 + 0.5);
      free_at = a.endTime;
      a.device = r.device;
      a.resource = r.row;
      a.id = static_cast<int32_t>(r.correlation);
      a.linked = linked_ && r.correlation ? linked_(static_cast<int32_t>(r.correlation)) : nullptr;
      a.addMetadataQuoted("device", "neuron:" + std::to_string(r.device));
      a.addMetadataQuoted("engine", r.row_name);
      a.addMetadataQuoted("time", "modelled by torchneuron.costmodel");
      a.addMetadata("host us", (r.end_ns - r.start_ns) / 1e3);
      a.addMetadata("correlation", r.correlation);
      rows_[{r.device, r.row}] = r.row_name;
      a.log(logger);
    }
    buffer_.span.opCount = buffer_.gpuOpCount = static_cast<int>(recs.size());
  }

  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked, int64_t,
                    int64_t) override {
    linked_ = std::move(linked);
    processTrace(logger);
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    return std::make_unique<libkineto::DeviceInfo>(libkineto::DeviceInfo{0, 0, "neuron 0", "neuron:0 (modelled)"});
  }

  std::vector<libkineto::ResourceInfo> getResourceInfos() override {
    std::vector<libkineto::ResourceInfo> out;
    for (const auto& [key, name] : rows_) out.push_back({key.second, key.second, key.first, name + " engine"});
    return out;
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override {
    return std::make_unique<libkineto::CpuTraceBuffer>(std::move(buffer_));
  }

  void pushCorrelationId(uint64_t id) override { t_correlation.push_back(id); }
  void popCorrelationId() override { pop(); }
  void pushUserCorrelationId(uint64_t id) override { t_correlation.push_back(id); }
  void popUserCorrelationId() override { pop(); }

 private:
  static void pop() {
    if (!t_correlation.empty()) t_correlation.pop_back();
  }

  static py::list specs(const Specs& ts) {  // [(shape, torch.dtype)]
    py::list out;
    for (const auto& [shape, dtype] : ts)
      out.append(
          py::make_tuple(py::tuple(py::cast(shape)),
                         py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype)))));
    return out;
  }

  // Modelled device time of the records the caller did not cost: one call into the cost model for the trace.
  void cost(std::vector<KernelRecord>& recs) {
    py::gil_scoped_acquire gil;
    try {
      if (!g_coster) g_coster = new py::object(py::module_::import("torchneuron.profiler.kineto").attr("cost"));
      py::list batch;
      std::vector<size_t> idx;
      for (size_t i = 0; i < recs.size(); ++i) {
        if (recs[i].device_s >= 0) continue;
        batch.append(py::make_tuple(recs[i].name, recs[i].view, specs(recs[i].inputs), specs(recs[i].outputs)));
        idx.push_back(i);
      }
      if (idx.empty()) return;
      auto res = (*g_coster)(batch).cast<std::vector<std::tuple<double, int, std::string>>>();
      TORCH_CHECK(res.size() == idx.size(), "the cost model returned ", res.size(), " costs for ", idx.size(),
                  " kernels");
      for (size_t k = 0; k < idx.size(); ++k)
        std::tie(recs[idx[k]].device_s, recs[idx[k]].row, recs[idx[k]].row_name) = res[k];
    } catch (const std::exception& e) {  // never lose the trace: the kernels stay, with zero modelled time
      std::string msg =
          std::string("neuron: the cost model failed on this trace's kernels; their device time is 0: ") + e.what();
      TORCH_WARN(msg);
      errors_.push_back(msg);
      for (auto& r : recs)
        if (r.device_s < 0) r.device_s = 0, r.row_name = "unknown";
    }
  }

  int64_t start_ns_ = 0, end_ns_ = 0;
  libkineto::CpuTraceBuffer buffer_;
  libkineto::getLinkedActivityCallback linked_;
  std::map<std::pair<int, int>, std::string> rows_;
  std::vector<std::string> errors_;
};

class NeuronActivityProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<libkineto::ActivityType>& availableActivities() const override { return activities_; }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config&) override {
    if (!types.count(libkineto::ActivityType::CONCURRENT_KERNEL)) return nullptr;  // the device was not asked for
    return std::make_unique<Session>();
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t, int64_t,
                                                                 const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config& config) override {
    return configure(types, config);
  }

 private:
  std::string name_{"neuron"};
  std::set<libkineto::ActivityType> activities_{libkineto::ActivityType::CONCURRENT_KERNEL};
};

REGISTER_PRIVATEUSE1_PROFILER(NeuronActivityProfiler);

}  // namespace

void KernelEvent::begin(const char* name, c10::DeviceIndex device, const c10::FunctionSchema* schema,
                        c10::ArrayRef<c10::IValue> inputs) {
  rec_ = new KernelRecord;
  // "neuron::mm" for aten::mm: the kernel is named apart from its host op (key_averages groups rows by name)
  std::string_view n(name);
  rec_->name = "neuron::" + std::string(n.substr(0, 6) == "aten::" ? n.substr(6) : n);
  rec_->device = device;
  rec_->correlation = t_correlation.empty() ? 0 : t_correlation.back();
  if (schema)
    for (const auto& r : schema->returns())
      if (r.alias_info() && !r.alias_info()->isWrite()) rec_->view = true;
  for (const auto& v : inputs) add_tensors(v, rec_->inputs);
  rec_->start_ns = c10::getTime();
}

void KernelEvent::finish(c10::ArrayRef<c10::IValue> outputs) {
  rec_->end_ns = c10::getTime();
  for (const auto& v : outputs) add_tensors(v, rec_->outputs);
  push(std::move(*rec_));
  drop();
}

void KernelEvent::drop() {
  delete rec_;
  rec_ = nullptr;
}

void bind_profiler(py::module_& m) {
  m.def(
      "_tracing_device", [] { return g_tracing_device.load(std::memory_order_relaxed); },
      "Whether torch.profiler is recording the neuron device's kernels.");
  m.def(
      "_record_device_event",
      [](const std::string& name, int device, int64_t start_ns, int64_t end_ns, double device_s, int row,
         const std::string& row_name) {
        if (!g_tracing_device.load()) return;
        KernelRecord r;
        r.name = name, r.device = static_cast<c10::DeviceIndex>(device);
        r.correlation = t_correlation.empty() ? 0 : t_correlation.back();
        r.start_ns = start_ns, r.end_ns = end_ns, r.device_s = device_s, r.row = row, r.row_name = row_name;
        push(std::move(r));
      },
      "Record a kernel run from Python (a compiled kernel) with its modelled device time; times from time.time_ns().");
  m.def("_profiler_registered",
        [] { return torch::profiler::impl::PrivateUse1ProfilerRegistry::instance().hasFactory(); });
}

}  // namespace torchneuron
