// Python bindings of the C++ core (torchneuron._C). Everything here is called once at registration or by the
// Python API layers; nothing on the per-op path goes through Python.
#include <torch/csrc/Generator.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/extension.h>

#include "runtime.h"

namespace torchneuron {
void bind_boundary(py::module_& m);        // boundary.cpp
void bind_profiler(py::module_& m);        // profiler.cpp
void bind_memory_history(py::module_& m);  // memory_history.cpp
void bind_lifecycle(py::module_& m);       // lifecycle.cpp
}  // namespace torchneuron

namespace {
std::map<std::string, int64_t> as_dict(const std::vector<std::pair<std::string, int64_t>>& v) {
  return {v.begin(), v.end()};
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  using namespace torchneuron;  // NOLINT(build/namespaces): the bindings name the whole core
  m.doc() = "torchneuron C++ core: allocator, guard, hooks, fallback, kernels, autocast";
  m.def(
      "_init",
      [](const std::vector<int64_t>& capacities, const std::string& unavailable,
         const std::vector<std::string>& device_checked, const std::vector<std::string>& one_kernel) {
        configure_devices(capacities, unavailable);
        register_hooks();
        install_fork_handler();
        return route_to_cpu_kernels(device_checked, one_kernel);
      },
      "Configure the modelled devices (one capacity in bytes per visible logical core, or none and the reason "
      "they are unusable), register the hooks, and route to the fallback the CPU kernels ATen would bypass "
      "(`device_checked`: composites refusing PrivateUse1; `one_kernel`: list ops run as one kernel; from the op "
      "table).",
      py::arg("capacities"), py::arg("unavailable"), py::arg("device_checked"), py::arg("one_kernel"));
  m.def("_set_policies", &set_policies, py::arg("dtype_policy"), py::arg("fallback_policy"),
        "Set the dtype policy ('trainium' | 'host') and the fallback policy ('warn' | 'silent' | 'error') by name; "
        "ValueError for an unknown name.");
  m.def("_set_op_table", &set_op_table, py::arg("native"), py::arg("exact"), py::arg("host_tensors"),
        py::arg("indices"), py::arg("overwrites"), py::arg("recurrent"), py::arg("structured"),
        "The op table's classification, by base name: ops the device runs natively, exact data movement (keeps "
        "fp64 bits), ops that take CPU index tensors alongside device ones, ops whose int64 results are indices, "
        "ops whose in-place form writes its argument whole without reading it, recurrent ops (an RNN layer); "
        "and by 'name.overload': the overloads ATen implements as structured kernels.");
  m.def(
      "_op_class",
      [](const std::string& name) {
        OpClass c = op_class(name);
        return py::dict(py::arg("base") = c.base, py::arg("native") = c.native, py::arg("exact") = c.exact,
                        py::arg("host_tensors") = c.host_tensors);
      },
      py::arg("name"),
      "How the C++ core classifies an op (\"aten::add_.Tensor\" or \"aten::add_\"): its base name "
      "and table flags.");
  m.def("_executed_ops", [] { return as_dict(executed_ops()); });
  m.def("_fallback_ops", [] { return as_dict(fallback_ops()); });
  m.def("_dtype_events", [] { return as_dict(dtype_events()); });
  m.def("_queued_ops", [] { return as_dict(queued_ops()); }, "Calls queued on a stream, per op.");
  m.def(
      "_waiting_ops", [] { return as_dict(waiting_ops()); },
      "Calls that made the host wait for their stream's queued work (data-dependent results, a first-met "
      "signature, the trainium rules), per op.");
  m.def(
      "_copied_ops", [] { return as_dict(copied_ops()); },
      "Queued calls whose kernel made its results in memory of its own, copied into the device's afterwards "
      "(ops with neither a pointwise nor a structured out= form), per op.");
  m.def("_clear_op_tracking", &clear_op_tracking);
  m.def("_execution_paths", [] { return as_dict(path_counts()); }, "How many launches took each path.");
  m.def(
      "_count_path",
      [](const std::string& name) {
        TORCH_CHECK_VALUE(count_path_named(name), "neuron: no execution path is named '", name, "'");
      },
      py::arg("name"), "Count a launch the Python side made (a compiled kernel's).");
  m.def(
      "_default_generator",
      [](int index) {
        return py::reinterpret_steal<py::object>(
            THPGenerator_initDefaultGenerator(default_generator(static_cast<c10::DeviceIndex>(index))));
      },
      "The default torch.Generator of a neuron device (what torch.neuron.manual_seed seeds).");
  m.def(
      "_host_alias",
      [](const at::Tensor& t) {
        TORCH_CHECK(t.device().type() == kNeuron, "_host_alias expects a neuron tensor, got one on ", t.device());
        drain_current(t.device().index());
        raise_if_poisoned(Access{touch(t, true, false)}, "a host view");  // never hand out bytes that were not computed
        return host_alias(t);
      },
      "A CPU tensor over the same memory as a neuron tensor (zero-copy; keep the neuron tensor alive while using it), "
      "after the current stream's queued work: what the host reads and writes through it happens now.");
  m.def("_poisoned_storages", &poisoned_storages,
        "How many device storages hold memory a failure left uncomputed (the inline fast path is off while any do).");
  m.def(
      "_sole_holder",
      [](const c10::intrusive_ptr<c10d::Work>& work) {
        return work.use_count() <= 2;  // the Python object's reference and this call's
      },
      py::arg("work"), "Whether the Python object is the only holder of this c10d work (gloo's run loop let go).");
  m.def(
      "_set_launch_blocking",
      [](bool on) {
        synchronize_device(-1);
        g_launch_blocking = on;
      },
      py::arg("on"), "TORCHNEURON_LAUNCH_BLOCKING: run every kernel at its launch (after the queued work finishes).");
  m.def("_launch_blocking", [] { return g_launch_blocking.load(); });
  m.def(
      "_set_launch_stacks", [](bool on) { g_launch_stacks = on; }, py::arg("on"),
      "Keep the launching Python stack of each queued kernel, for the error it may raise (default on).");
  m.def(
      "_set_eager_fusion",
      [](py::object fusable, py::object run, int64_t min_elements, size_t max_ops, size_t max_list, int after) {
        set_eager_fusion(fusable.ptr(), run.ptr(), FusionLimits{min_elements, max_ops, max_list, after});
      },
      py::arg("fusable"), py::arg("run"), py::arg("min_elements"), py::arg("max_ops"), py::arg("max_list"),
      py::arg("after"),
      "Install adaptive eager fusion: fusable(op name) -> bool, run(list of queued ops) -> (ops it ran fused, plan), "
      "and its limits (compiler/eager_fusion.py defines them).");
  m.def("_mark_run", &mark_run, py::arg("begin"),
        "Begin (True) or end a run the stream workers take whole (an optimizer step), whatever the host's timing.");
  m.def(
      "_set_verify_replay", &set_verify_replay, py::arg("on"),
      "Tests: rebuild every replayed fusion plan with the Python group builder and compare it with the replayed one.");
  m.def(
      "_replay_checks",
      [] {
        ReplayChecks c = replay_checks();
        return py::dict(py::arg("verified") = c.verified, py::arg("mismatched") = c.mismatched,
                        py::arg("last") = c.last);
      },
      "Replay verification: plans compared, how many differed, and what differed last.");
  m.def(
      "_fusion_counts",
      [] {
        FusionCounts c = fusion_counts();
        return py::dict(py::arg("kernels") = c.kernels, py::arg("ops") = c.ops, py::arg("cold") = c.cold);
      },
      "Fused kernels the stream workers ran, the queued ops they replaced, and the runs they ran unfused without "
      "building their group (not seen `after` times yet, or its kernel still compiling).");
  m.def(
      "_set_queue_everything",
      [](bool on) {
        synchronize_device(-1);
        g_queue_everything = on;
      },
      py::arg("on"),
      "Tests only: queue every kernel whose layout is known (small ones on an idle stream too), so "
      "that conformance suites run the queued path.");
  m.def("_queue_everything", [] { return g_queue_everything.load(); });
  m.def("_set_internal_math", &set_internal_math,
        "Skip the dtype policy on this thread (PyTorch's own printing math); returns the previous setting.");
  m.def("_note_device_result", &note_device_result,
        "Apply the dtype policy to a neuron tensor computed outside the op fallback (a collective's reduction).");
  bind_boundary(m);
  bind_profiler(m);
  bind_memory_history(m);
  bind_lifecycle(m);
}
