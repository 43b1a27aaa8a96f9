// Adaptive eager fusion, the device's half: a queued launch of a large functional op that fuses (the op table's
// `fuse`, asked of compiler/eager_fusion.py once per op) carries a FusableOp; a stream worker that finds several
// of them queued back to back (the host ran ahead) hands the run to eager_fusion.run_queued, which fuses its
// leading ops into one Inductor CPU kernel (compiled once a group recurs) and runs it, or declines. Declined ops run
// one by one as they were queued, so fusion changes speed only. Python is entered holding the GIL, on the worker.
#include <Python.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include "runtime.h"

namespace torchneuron {
namespace {

PyObject* g_fusable = nullptr;  // eager_fusion.fusable, kept for the process
PyObject* g_run = nullptr;      // eager_fusion.run_queued
std::atomic<bool> g_installed{false};
std::atomic<int64_t> g_kernels{0}, g_ops{0};

bool python_usable() { return Py_IsInitialized() && !_Py_IsFinalizing(); }

std::string qualified_name(const c10::OperatorHandle& op) {
  const auto& n = op.schema().operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

}  // namespace

void set_eager_fusion(PyObject* fusable, PyObject* run) {
  Py_XINCREF(fusable);
  Py_XINCREF(run);
  g_fusable = fusable, g_run = run;
  g_installed.store(fusable && run);
}

bool fusion_wanted(const c10::OperatorHandle& op, OpEntry& e, int64_t elements) {
  if (elements < kFuseElements || !g_installed.load(std::memory_order_relaxed)) return false;
  uint8_t known = e.fuses.load(std::memory_order_relaxed);
  if (known) return known == 2;
  if (!python_usable()) return false;
  bool yes = false;
  {
    pybind11::gil_scoped_acquire gil;
    PyObject* r = PyObject_CallFunction(g_fusable, "s", qualified_name(op).c_str());
    if (r) yes = PyObject_IsTrue(r) == 1;
    else PyErr_Clear();  // an op eager fusion cannot look up does not fuse
    Py_XDECREF(r);
  }
  e.fuses.store(yes ? 2 : 1);
  return yes;
}

size_t run_fused(c10::ArrayRef<const FusableOp*> ops) {
  if (!g_installed.load(std::memory_order_relaxed) || !python_usable()) return 0;
  pybind11::gil_scoped_acquire gil;
  size_t ran = 0;
  try {
    pybind11::list group;
    for (const FusableOp* f : ops) {
      pybind11::list args, outs;
      for (const c10::IValue& v : f->args) args.append(torch::jit::toPyObject(v));
      for (const at::Tensor& o : f->outs) outs.append(torch::jit::toPyObject(o));
      group.append(pybind11::make_tuple(qualified_name(f->op), args, outs));
    }
    ran = pybind11::reinterpret_borrow<pybind11::object>(g_run)(group).cast<size_t>();
  } catch (const std::exception&) {  // run_queued never raises; a conversion that fails means: unfused
    PyErr_Clear();
    return 0;
  }
  if (ran > 1) g_kernels.fetch_add(1, std::memory_order_relaxed), g_ops.fetch_add(ran, std::memory_order_relaxed);
  return ran > 1 ? std::min(ran, ops.size()) : 0;
}

FusionCounts fusion_counts() { return {g_kernels.load(), g_ops.load()}; }
void clear_fusion_counts() { g_kernels = 0, g_ops = 0; }

}  // namespace torchneuron
