// fusion.cpp's interface: adaptive eager fusion on the stream workers.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "op_tracking.h"

struct _object;
typedef struct _object PyObject;  // Python.h's, declared for the fusion entry points

namespace torchneuron {

// ---- fusion.cpp: adaptive eager fusion (compiler/eager_fusion.py compiles a group; the stream worker runs it) ----
// A queued functional op as eager fusion sees it: the op, its arguments on the host (CPU views of device memory;
// wrapped numbers as numbers) and CPU views of the results its launch handed out.
struct FusableOp {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;
  std::vector<at::Tensor> outs;
};
// Eager fusion's limits, defined in compiler/eager_fusion.py and handed over by set_eager_fusion.
struct FusionLimits {
  int64_t min_elements = 0;  // smaller ops are not worth a fused kernel (the hand-over to Python costs tens of us)
  size_t max_ops = 0;        // queued ops a stream worker hands over as one run
  size_t max_list = 0;       // the longest list of a list op that may join a group
  int after = 1;             // sightings of a run before its group is built and compiled
};
size_t fusion_max_ops();  // 0 until fusion is installed
// Should this queued launch carry a FusableOp: fusion is installed, the op fuses (the op table, asked once per op),
// it is large enough, and a list op's list is no longer than eager fusion takes (`list`: its length, 0 for others).
bool fusion_wanted(const c10::OperatorHandle& op, OpEntry& e, int64_t elements, size_t list);
// On a stream worker: run the leading ops of `ops` that eager fusion fuses as one kernel; how many it ran (0: none).
// `error`: set when the fused kernel raised; the count is then the ops it covered, which all failed. `unfused`: when
// none ran because the leading ops' group is not compiled yet (or not seen `after` times yet), how many ops it holds
// (the worker runs them one by one, offering no part of them again: each part would be a group of its own).
size_t run_fused(c10::ArrayRef<const FusableOp*> ops, std::exception_ptr& error, size_t& unfused);
// torchneuron's import installs the Python side: fusable(name) -> bool, run(list of ops) -> (int, plan), and its
// limits.
void set_eager_fusion(PyObject* fusable, PyObject* run, FusionLimits limits);
struct FusionCounts {
  int64_t kernels = 0, ops = 0;  // fused kernels run, the ops they replaced
  int64_t cold = 0;              // runs that ran unfused without entering Python (not recurring, or compiling)
};
FusionCounts fusion_counts();
// Tests: rebuild every replayed plan with the Python group builder and compare (replay verification).
void set_verify_replay(bool on);
struct ReplayChecks {
  int64_t verified = 0, mismatched = 0;
  std::string last;  // what differed last
};
ReplayChecks replay_checks();
void clear_fusion_counts();

}  // namespace torchneuron
