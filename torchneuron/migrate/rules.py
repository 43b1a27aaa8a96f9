"""The CUDA lock-in rule catalogue: one table that `check`, `fix`, the flake8 plugin and the docs all read.

Each `Rule.match` entry is a pattern in a small notation, resolved on qualified names (so aliases such as
`import torch.cuda as tc` or `from torch.cuda.amp import autocast` are seen through):

  torch.cuda.synchronize       any use of that qualified name; a trailing `.*` matches the names below it
  .cuda()   .is_cuda           a method call / an attribute read on any object
  import triton                importing the module (or one of its submodules)
  f(p@i)   f(p=)   f(!p@i)     a call of `f` with parameter `p` (keyword `p` or position `i`), or without it;
                               the first parameter is the subject and, when `value` is set, must match it;
                               `f` may be `prefix.*`, `.method` or `*` (any callable)
  <str>                        a string literal (f-strings `f"cuda:{i}"`, `"cuda:{}".format(i)`, `"cuda:%d" % i`
                               and `"cuda:" + str(i)` read as `cuda:{}`), matched against `value`
  <assigned str>               such a string assigned to a variable (bare `"cuda"`: to a device-like name)
  if torch.cuda.is_available(): P     P inside code that only runs when an accelerator is present
  <ladder>   <syntax error>    an if/elif ladder over vendor availability checks; a file that does not parse

`value` is a regular expression the subject string must match in full, `[...]` (a list or tuple display) or
`<index>` (a name, attribute, subscript or integer). When patterns of several rules match the same code, the
most specific wins (guarded, exact name, method, prefix, any callable), then the earlier rule.

`replacement` is device-agnostic PyTorch. For `auto` rules it is also the template `fix` instantiates: `torch`
and `torch.distributed` become the module's own aliases, `device` the hoisted device (CPU fallback), or
`torch.device(device.type, i)` when the matched code names an index `i`; `__func__` the function as the code
spells it; `x` is the subject (the receiver of
a method, the first argument of a call, the matched argument); `...` stands for the original arguments, with
the positional ones named by `params` passed as keywords; an empty replacement deletes the argument. An
`if torch.accelerator.is_available(): ...` or `... if torch.accelerator.is_available() else ...` guard keeps
the rewrite runnable on CPU-only hosts and is dropped where the code is already guarded. `only` names the
condition under which the rewrite is safe (see `check.ONLY`); elsewhere the finding becomes a suggestion.
"""
from __future__ import annotations

from dataclasses import dataclass

FIX_KINDS = ("auto", "suggest", "report")
CUDA = r"cuda(:\d+|:\{\})?"  # a CUDA device string, optionally indexed
VENDORS = ("cuda", "mps", "xpu", "npu", "mlu", "hpu", "musa", "mtia", "neuron", "xla")  # for <ladder>
# no-ops off CUDA: code guarded by `torch.cuda.is_available()` that only does these may run anywhere
BENIGN = {"NRN030", "NRN031", "NRN032", "NRN033", "NRN034", "NRN035", "NRN060", "NRN065"}
# a file none of whose lines matches this cannot trigger a rule: lets `check` skip most files unparsed
TRIGGER = (r"(?i)cuda|cudnn|cublas|nccl|triton|nvidia|nvml|nvtx|apex|GradScaler|device_ids|output_device|"
           r"DataParallel|reduce-overhead|max-autotune|pin_memory|record_stream|\.cu\b")


@dataclass(frozen=True)
class Rule:
    code: str
    category: str
    match: tuple[str, ...]
    message: str
    replacement: str
    fix: str  # auto: rewritten by `fix`; suggest: needs a decision, `check` shows the replacement; report: none
    why: str  # why this fix kind
    example: str  # smallest code the rule fires on (tested, and shown in docs/migration.md)
    value: str | None = None
    params: tuple[str, ...] = ()
    index: str | None = None
    only: str | None = None
    whole: bool = False  # the rewrite replaces the whole call, not just its subject argument
    indexed: str | None = None  # the replacement when the matched code names an index (default: `device` in
    #                             `replacement` becomes `torch.device(device.type, i)`)
    noqa: str | None = None  # codes the rewrite's own lines are exempt from (they must stay as written)
    raises_off_cuda: bool = False  # the matched code raises at once on a host without CUDA: left alone, it stops
    #                                a rewritten file from running, so `fix` then leaves the whole file untouched

    def __post_init__(self):
        assert self.fix in FIX_KINDS, self


R = Rule
RULES: list[Rule] = [
  R("NRN000", "input", ("<syntax error>",), "file could not be analysed", "fix the syntax error", "report",
    "an unparsable file is never rewritten; it is reported so CI does not pass silently", "def f(:\n"),

  # device selection and placement
  R("NRN001", "device", (".cuda()",), "`.cuda()` moves to CUDA only", "x.to(device, ...)", "auto",
    "`Tensor.to`/`Module.to` take any device, and the hoisted `device` falls back to CPU; an index becomes "
    "`torch.device(device.type, i)`", "model.cuda()", params=("device", "non_blocking", "memory_format"),
    index="device"),
  R("NRN002", "device", ("torch.device(type@0)",), "`torch.device(\"cuda\")` names one vendor", "device",
    "auto", "the hoisted device has the same role on every backend; `\"cuda:i\"`, `f\"cuda:{i}\"` and "
    "`torch.device(\"cuda\", i)` keep their index", 'dev = torch.device("cuda")', value=CUDA,
    params=("type", "index"), index="index", whole=True),
  R("NRN003", "device", ("if torch.cuda.is_available(): torch.device(type@0, !index@1)",),
    "`torch.device(\"cuda\")` in code that runs only with an accelerator",
    "torch.accelerator.current_accelerator()", "auto",
    "the guard guarantees an accelerator, so the current one is exactly what was meant; no hoisting needed",
    'd = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")', value="cuda",
    whole=True),
  R("NRN004", "device", ("torch.*(device=)", ".to(device@0)", ".to_empty(device=)", ".new_empty(device=)",
                         ".new_zeros(device=)", ".new_ones(device=)", ".new_full(device=)", ".new_tensor(device=)",
                         "torch.set_default_device(device@0)", "torch.Generator(device@0)"),
    "CUDA device string passed to a PyTorch API", "device", "auto",
    "PyTorch APIs take a `torch.device` wherever they take a string", 'x = torch.zeros(3, device="cuda")',
    value=CUDA),
  R("NRN005", "device", ("torch.load(map_location@1)", "torch.serialization.load(map_location@1)",
                         "torch.jit.load(map_location@1)"),
    "`map_location` loads the checkpoint onto CUDA", "device", "auto",
    "loading onto the hoisted device works on every backend and on CPU-only hosts; an index is kept except on "
    "CPU, where `torch.load` refuses `cpu:0`", 'sd = torch.load("ckpt.pt", map_location="cuda")', value=CUDA,
    indexed='torch.device(device.type, __index__) if device.type != "cpu" else device'),
  R("NRN006", "device", ("torch.random.fork_rng(device_type=)", "torch.get_autocast_dtype(device_type@0)",
                         "torch.set_autocast_dtype(device_type@0)", "torch.is_autocast_enabled(device_type@0)",
                         "torch.set_autocast_enabled(device_type@0)", "torch.amp.is_autocast_available(device_type@0)",
                         "torch.amp.custom_fwd(device_type=)", "torch.amp.custom_bwd(device_type=)"),
    "`device_type=\"cuda\"` names one vendor", "device.type", "auto",
    "these take the type of the device the code runs on; `device.type` is that, on every backend (other "
    "`device_type=` parameters, such as test decorators', may mean CUDA itself: left to NRN009)",
    'torch.random.fork_rng(device_type="cuda")', value="cuda"),
  R("NRN007", "device", ("*(device=)",), "`device=\"cuda\"` passed to a non-PyTorch callable", "device.type",
    "auto", "keeps the argument a string (the callee may compare it) while naming the actual device type",
    'pipe = make_pipeline(device="cuda")', value="cuda"),
  R("NRN008", "device", ("if torch.cuda.is_available(): <str>",),
    "`\"cuda\"` chosen only when an accelerator is present", "torch.accelerator.current_accelerator().type",
    "auto", "the guard guarantees an accelerator; this is the PyTorch tutorials' device-selection idiom",
    'name = "cuda" if torch.cuda.is_available() else "cpu"', value="cuda"),
  R("NRN009", "device", ("<str>",), "CUDA device string", "compare `torch.device(d).type` with `device.type`, "
    "or test `!= \"cpu\"`", "suggest",
    "in comparisons, defaults and dictionaries the intent (is it CUDA? any accelerator?) is a decision",
    'if args.device == "cuda":\n    pass', value=CUDA),
  R("NRN010", "device", ("torch.cuda.is_available",), "`torch.cuda.is_available()` asks about one vendor",
    "torch.accelerator.is_available(...)", "auto",
    "the same question for whatever accelerator is present; a suggestion where the guarded code stays "
    "CUDA-only, since the rewrite would run it on other devices", "ok = torch.cuda.is_available()"),
  R("NRN011", "device", ("torch.cuda.device_count",), "`torch.cuda.device_count()` counts CUDA devices only",
    "torch.accelerator.device_count(...)", "auto", "same semantics, any backend; 0 on CPU-only hosts as before",
    "n = torch.cuda.device_count()"),
  R("NRN012", "device", ("torch.cuda.current_device",), "`torch.cuda.current_device()` is CUDA-only",
    "use `torch.accelerator.current_device_index()` (it raises without an accelerator)", "suggest",
    "the accelerator call raises on CPU-only hosts, and what to use there (0? None?) depends on the caller",
    "i = torch.cuda.current_device()"),
  R("NRN013", "device", ("torch.cuda.set_device",), "`torch.cuda.set_device()` is CUDA-only",
    "if torch.accelerator.is_available(): torch.accelerator.set_device_index(...)", "auto",
    "same effect for any accelerator and a no-op on CPU-only hosts; only for an integer index, since a "
    "`\"cuda:i\"` string or CUDA `torch.device` would be rejected by the accelerator API",
    "torch.cuda.set_device(local_rank)", only="int_arg"),
  R("NRN014", "device", ("torch.cuda.device",), "`torch.cuda.device(i)` selects a CUDA device",
    "use `torch.accelerator.device_index(i)`", "suggest",
    "the accelerator context manager takes only an int and raises on CPU-only hosts",
    "with torch.cuda.device(1):\n    pass"),
  R("NRN015", "device", (".is_cuda",), "`.is_cuda` is False on every other accelerator",
    'use `x.device.type != "cpu"` (any accelerator) or compare with `device.type`', "suggest",
    "whether the test means CUDA or any accelerator is a decision",
    "if x.is_cuda:\n    pass"),
  R("NRN016", "device", tuple(f"torch.cuda.{t}Tensor" for t in ("Float", "Double", "Half", "BFloat16", "Long",
                                                                  "Int", "Short", "Char", "Byte", "Bool")),
    "legacy CUDA tensor type", "use `torch.tensor(data, dtype=..., device=device)`", "suggest",
    "typed constructors have no device-agnostic form; dtype and data need rewriting by hand",
    "t = torch.cuda.FloatTensor([1.0])"),
  R("NRN017", "device", ("torch.cuda",), "the `torch.cuda` module used as a value",
    "use `torch.get_device_module(device)`", "suggest",
    "the code calls into the module later; whether every call exists on the other module is unknown",
    "mod = torch.cuda"),
  R("NRN018", "device", ("<str>",), "`CUDA_VISIBLE_DEVICES` selects CUDA devices",
    "use the backend's own visibility variable (neuron: `NEURON_RT_VISIBLE_CORES`) or launcher flags", "report",
    "a process environment contract with the CUDA driver; no PyTorch API replaces it",
    'os.putenv("CUDA_VISIBLE_DEVICES", "0")', value="CUDA_VISIBLE_DEVICES"),

  R("NRN019", "device", ("<assigned str>",), "a CUDA device string assigned to a variable",
    "device.type", "auto",
    "the variable names the device the script runs on: the hoisted device's type, with the index kept "
    "(`f\"cuda:{rank}\"`, `\"cuda:%d\" % rank`, `\"cuda:\" + str(rank)`) except on CPU, where `torch.load` refuses "
    "`cpu:0`; a bare `\"cuda\"` only for a target named like a device (`device`, `dev`, `args.device`, ...)",
    'device = f"cuda:{local_rank}"', value=CUDA,
    indexed='f"{device.type}:{__index__}" if device.type != "cpu" else "cpu"'),

  # mixed precision
  R("NRN020", "amp", ("torch.cuda.amp.autocast", "torch.cuda.amp.autocast_mode.autocast"),
    "`torch.cuda.amp.autocast` is deprecated and CUDA-only", "torch.amp.autocast(device.type, ...)", "auto",
    "the generic autocast with the hoisted device type; positional arguments become keywords because the "
    "signatures differ; the dtype default is the device's own", "with torch.cuda.amp.autocast():\n    pass",
    params=("enabled", "dtype", "cache_enabled")),
  R("NRN021", "amp", ("torch.cuda.amp.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler"),
    "`torch.cuda.amp.GradScaler` is deprecated and CUDA-only", "torch.amp.GradScaler(device.type, ...)", "auto",
    "the generic scaler takes the device first; the remaining parameters are unchanged",
    "scaler = torch.cuda.amp.GradScaler()"),
  R("NRN022", "amp", ("torch.autocast(device_type@0)", "torch.amp.autocast(device_type@0)",
                      "torch.amp.autocast_mode.autocast(device_type@0)", "torch.amp.GradScaler(device@0)",
                      "torch.amp.grad_scaler.GradScaler(device@0)"),
    "autocast/GradScaler for `\"cuda\"`: silently disabled on other devices", "device.type", "auto",
    "these take a device-type string; off CUDA the literal turns AMP off with only a warning",
    'with torch.autocast("cuda", dtype=torch.bfloat16):\n    pass', value="cuda"),
  R("NRN023", "amp", ("torch.amp.GradScaler(!device@0)", "torch.amp.grad_scaler.GradScaler(!device@0)"),
    "`torch.amp.GradScaler()` defaults to `\"cuda\"`", "torch.amp.GradScaler(device.type, ...)", "auto",
    "without a device the scaler targets CUDA and disables itself elsewhere", "scaler = torch.amp.GradScaler()"),
  R("NRN024", "amp", ("torch.cuda.amp.custom_fwd", "torch.cuda.amp.autocast_mode.custom_fwd"),
    "`torch.cuda.amp.custom_fwd` is deprecated and CUDA-only",
    "torch.amp.custom_fwd(..., device_type=device.type)", "auto", "the generic decorator needs the device type",
    "@torch.cuda.amp.custom_fwd\ndef forward(ctx, x):\n    return x", params=("fwd", "cast_inputs")),
  R("NRN025", "amp", ("torch.cuda.amp.custom_bwd", "torch.cuda.amp.autocast_mode.custom_bwd"),
    "`torch.cuda.amp.custom_bwd` is deprecated and CUDA-only",
    "torch.amp.custom_bwd(..., device_type=device.type)", "auto", "the generic decorator needs the device type",
    "@torch.cuda.amp.custom_bwd\ndef backward(ctx, g):\n    return g", params=("bwd",)),
  R("NRN026", "amp", ("torch.cuda.is_bf16_supported",), "`torch.cuda.is_bf16_supported()` is False off CUDA",
    'use `torch.bfloat16 in torch.accelerator.get_device_capability()["supported_dtypes"]`', "suggest",
    "off CUDA it silently picks the fp16 + GradScaler path; the capability query needs backend support",
    "dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16"),

  # backend flags and environment knobs
  R("NRN030", "backend", ("torch.backends.cudnn.benchmark",), "cuDNN autotuning flag",
    'nothing to do: a no-op off CUDA (or set it only when `device.type == "cuda"`)', "report",
    "harmless elsewhere; reported so the CUDA-only tuning is visible", "torch.backends.cudnn.benchmark = True"),
  R("NRN031", "backend", ("torch.backends.cudnn.deterministic",), "cuDNN determinism flag",
    "use `torch.use_deterministic_algorithms(True)`", "suggest",
    "the generic switch covers every backend but is broader: it raises for ops without a deterministic kernel",
    "torch.backends.cudnn.deterministic = True"),
  R("NRN032", "backend", ("torch.backends.cuda.matmul.allow_tf32", "torch.backends.cudnn.allow_tf32"),
    "TF32 flag for CUDA matmul/convolution",
    'use `torch.backends.fp32_precision = "tf32"` or `torch.set_float32_matmul_precision("high")`', "suggest",
    "the generic knobs also change CPU and other backends' numerics",
    "torch.backends.cuda.matmul.allow_tf32 = True"),
  R("NRN033", "backend", ("torch.backends.cuda.sdp_kernel", "torch.backends.cuda.enable_flash_sdp",
                          "torch.backends.cuda.enable_mem_efficient_sdp", "torch.backends.cuda.enable_math_sdp",
                          "torch.backends.cuda.enable_cudnn_sdp"),
    "CUDA scaled-dot-product attention kernel selection", "use `torch.nn.attention.sdpa_kernel([SDPBackend...])`",
    "suggest", "the backend list is a choice; flash/efficient kernels may not exist on the target",
    "torch.backends.cuda.enable_flash_sdp(False)"),
  R("NRN034", "backend", ("torch.backends.cudnn.*", "torch.backends.cuda.*"), "CUDA/cuDNN backend setting",
    'no portable equivalent; set it only when `device.type == "cuda"`', "report",
    "these tune NVIDIA libraries and have no generic counterpart", "torch.backends.cudnn.enabled = False"),
  R("NRN035", "backend", ("<str>",), "CUDA/NCCL environment knob",
    "use the target backend's equivalent (e.g. `PYTORCH_ALLOC_CONF` for the allocator)", "report",
    "environment contracts with NVIDIA libraries; no PyTorch API replaces them",
    'os.putenv("CUDA_LAUNCH_BLOCKING", "1")',
    value=r"CUDA_LAUNCH_BLOCKING|CUDA_DEVICE_ORDER|PYTORCH_CUDA_ALLOC_CONF|CUBLAS_WORKSPACE_CONFIG|"
          r"(TORCH_)?NCCL_\w+"),

  # synchronisation, timing, streams and events
  R("NRN040", "sync", ("torch.cuda.synchronize",), "`torch.cuda.synchronize()` is CUDA-only",
    "if torch.accelerator.is_available(): torch.accelerator.synchronize(...)", "auto",
    "waits for whatever accelerator is present; the guard keeps it a no-op on CPU-only hosts",
    "torch.cuda.synchronize()"),
  R("NRN041", "sync", ("torch.cuda.Event",), "`torch.cuda.Event` is CUDA-only", "torch.Event(...)", "auto",
    "the generic event of the current accelerator; positional flags become keywords (`torch.Event` takes a "
    "device first). Recording still needs an accelerator: the CPU backend has no events",
    "start = torch.cuda.Event(enable_timing=True)", params=("enable_timing", "blocking", "interprocess"),
    raises_off_cuda=True),
  R("NRN042", "sync", ("torch.cuda.Stream",), "`torch.cuda.Stream` is CUDA-only",
    "torch.get_device_module(device).Stream(...)", "auto",
    "the device module's stream, of one family with its `stream`, `current_stream` and `Event` (on CPU-only hosts "
    "torch.cpu's no-op ones, which a `torch.Stream` cannot be mixed with); only without a device argument, which "
    "would name CUDA", "s = torch.cuda.Stream()", params=("device", "priority"), only="no_device",
    raises_off_cuda=True),
  R("NRN043", "sync", ("torch.cuda.stream",), "`torch.cuda.stream(s)` context is CUDA-only",
    "torch.get_device_module(device).stream(x)", "auto",
    "the device module's stream context (a no-op on CPU-only hosts)", "with torch.cuda.stream(s):\n    pass",
    only="with_item", raises_off_cuda=True),
  R("NRN044", "sync", ("torch.cuda.current_stream",), "`torch.cuda.current_stream()` is CUDA-only",
    "torch.get_device_module(device).current_stream(...)", "auto",
    "the device module's current stream; on CPU-only hosts `torch.cpu.current_stream()`, whose `wait_stream`, "
    "`record_event` and `wait_event` do nothing", "torch.cuda.current_stream().wait_stream(s)", only="no_keyword",
    raises_off_cuda=True),
  R("NRN046", "sync", ("torch.cuda.default_stream",), "`torch.cuda.default_stream()` is CUDA-only",
    "torch.get_device_module(device).default_stream(...) if torch.accelerator.is_available() else "
    "torch.cpu.current_stream()", "auto",
    "the device module's default stream (CUDA, neuron); on CPU-only hosts the CPU's no-op stream",
    "s = torch.cuda.default_stream()", only="no_keyword", raises_off_cuda=True),
  R("NRN047", "sync", (".record_stream()",), "`Tensor.record_stream` exists only for accelerator streams",
    "if torch.accelerator.is_available(): x.record_stream(...)", "auto",
    "the caching allocator's cross-stream bookkeeping; CPU tensors and torch.cpu's streams have none, so it is "
    "skipped on CPU-only hosts", "x.record_stream(s)"),
  R("NRN045", "sync", ("torch.cuda.ExternalStream", "torch.cuda.StreamContext", "torch.cuda.set_stream",
                       "torch.cuda.set_sync_debug_mode", "torch.cuda.get_stream_from_external"),
    "CUDA stream plumbing", "use `torch.accelerator.set_stream` / `torch.Stream`", "report",
    "these wrap raw CUDA stream handles; no device-agnostic equivalent", "torch.cuda.set_sync_debug_mode(1)"),

  # memory
  R("NRN050", "memory", ("torch.cuda.empty_cache",), "`torch.cuda.empty_cache()` is CUDA-only",
    "if torch.accelerator.is_available(): torch.accelerator.empty_cache(...)", "auto",
    "same call on the accelerator allocator; guarded because it raises without an accelerator",
    "torch.cuda.empty_cache()"),
  R("NRN051", "memory", ("torch.cuda.memory_allocated",), "`torch.cuda.memory_allocated()` is 0 off CUDA",
    "torch.accelerator.memory_allocated(...) if torch.accelerator.is_available() else 0", "auto",
    "same statistic on any accelerator; 0 on CPU-only hosts, as before", "m = torch.cuda.memory_allocated()"),
  R("NRN052", "memory", ("torch.cuda.max_memory_allocated",), "`torch.cuda.max_memory_allocated()` is 0 off CUDA",
    "torch.accelerator.max_memory_allocated(...) if torch.accelerator.is_available() else 0", "auto",
    "same statistic on any accelerator; 0 on CPU-only hosts, as before", "m = torch.cuda.max_memory_allocated()"),
  R("NRN053", "memory", ("torch.cuda.memory_reserved", "torch.cuda.memory_cached"),
    "`torch.cuda.memory_reserved()` is 0 off CUDA",
    "torch.accelerator.memory_reserved(...) if torch.accelerator.is_available() else 0", "auto",
    "same statistic on any accelerator; 0 on CPU-only hosts, as before", "m = torch.cuda.memory_reserved()"),
  R("NRN054", "memory", ("torch.cuda.max_memory_reserved", "torch.cuda.max_memory_cached"),
    "`torch.cuda.max_memory_reserved()` is 0 off CUDA",
    "torch.accelerator.max_memory_reserved(...) if torch.accelerator.is_available() else 0", "auto",
    "same statistic on any accelerator; 0 on CPU-only hosts, as before", "m = torch.cuda.max_memory_reserved()"),
  R("NRN055", "memory", ("torch.cuda.reset_peak_memory_stats", "torch.cuda.reset_max_memory_allocated"),
    "CUDA peak-memory reset", "if torch.accelerator.is_available(): torch.accelerator.reset_peak_memory_stats(...)",
    "auto", "same reset on the accelerator allocator; guarded because it raises without an accelerator",
    "torch.cuda.reset_peak_memory_stats()"),
  R("NRN056", "memory", ("torch.cuda.memory_stats",), "`torch.cuda.memory_stats()` is CUDA-only",
    "torch.accelerator.memory_stats(...) if torch.accelerator.is_available() else {}", "auto",
    "same statistics dictionary; empty on CPU-only hosts", "s = torch.cuda.memory_stats()"),
  R("NRN057", "memory", ("torch.cuda.mem_get_info",), "`torch.cuda.mem_get_info()` is CUDA-only",
    "torch.accelerator.get_memory_info(...) if torch.accelerator.is_available() else (0, 0)", "auto",
    "(free, total) of the accelerator; `(0, 0)` on CPU-only hosts, like the memory statistics (code dividing by "
    "the total needs its own CPU branch)", "free, total = torch.cuda.mem_get_info()", only="no_keyword"),
  R("NRN058", "memory", ("torch.cuda.memory_summary", "torch.cuda.memory_snapshot",
                         "torch.cuda.memory._record_memory_history", "torch.cuda.memory._snapshot",
                         "torch.cuda.memory._dump_snapshot"),
    "CUDA memory debugging", "no portable summary or snapshot yet; `torch.accelerator.memory_stats()` has the counters",
    "report", "the snapshot/summary tooling exists only for CUDA", "print(torch.cuda.memory_summary())"),
  R("NRN059", "memory", ("torch.cuda.set_per_process_memory_fraction", "torch.cuda.caching_allocator_alloc",
                         "torch.cuda.caching_allocator_delete", "torch.cuda.MemPool", "torch.cuda.use_mem_pool",
                         "torch.cuda.CUDAPluggableAllocator", "torch.cuda.memory.change_current_allocator"),
    "CUDA allocator control", "no portable equivalent (allocator settings are the backend's)", "report",
    "these configure the CUDA caching allocator itself", "torch.cuda.set_per_process_memory_fraction(0.5)"),

  # RNG and checkpoint RNG state
  R("NRN060", "rng", ("torch.cuda.manual_seed_all",), "CUDA-only seeding: other devices stay unseeded",
    "if torch.accelerator.is_available(): torch.get_device_module(device).manual_seed_all(...)", "auto",
    "seeds what it seeded before, the accelerator's generators (not the CPU's, which `torch.manual_seed` would "
    "reseed); nothing on CPU-only hosts, as before", "torch.cuda.manual_seed_all(0)"),
  R("NRN065", "rng", ("torch.cuda.manual_seed",), "CUDA-only seeding: other devices stay unseeded",
    "if torch.accelerator.is_available(): torch.get_device_module(device).manual_seed(...)", "auto",
    "seeds the current accelerator's generator, as before on CUDA; nothing on CPU-only hosts",
    "torch.cuda.manual_seed(0)"),
  R("NRN061", "rng", ("torch.cuda.get_rng_state",), "CUDA RNG state (often saved in checkpoints)",
    "torch.get_device_module(device).get_rng_state(...) if torch.accelerator.is_available() else "
    "torch.empty(0, dtype=torch.uint8)", "auto",
    "the accelerator generator's state; an empty state on CPU-only hosts, which the matching `set_rng_state` "
    "rewrite skips (a checkpoint from another device type still needs a decision)",
    'ckpt["cuda_rng"] = torch.cuda.get_rng_state()', only="no_keyword"),
  R("NRN066", "rng", ("torch.cuda.get_rng_state_all",), "CUDA RNG states (often saved in checkpoints)",
    "torch.get_device_module(device).get_rng_state_all() if torch.accelerator.is_available() else []", "auto",
    "every accelerator generator's state; none on CPU-only hosts", 'ckpt["rng"] = torch.cuda.get_rng_state_all()',
    only="no_args"),
  R("NRN062", "rng", ("torch.cuda.set_rng_state",), "restores CUDA RNG state",
    "if torch.accelerator.is_available(): torch.get_device_module(device).set_rng_state(...)", "auto",
    "restores the accelerator generator saved by the same script on the same device type; skipped on CPU-only "
    "hosts, which have no accelerator generator", 'torch.cuda.set_rng_state(ckpt["cuda_rng"])'),
  R("NRN067", "rng", ("torch.cuda.set_rng_state_all",), "restores CUDA RNG states",
    "if torch.accelerator.is_available(): torch.get_device_module(device).set_rng_state_all(...)", "auto",
    "restores every accelerator generator; skipped on CPU-only hosts", 'torch.cuda.set_rng_state_all(ckpt["rng"])'),
  R("NRN063", "rng", ("torch.cuda.seed", "torch.cuda.seed_all", "torch.cuda.initial_seed"),
    "CUDA-only seed query/randomisation", "use `torch.seed()` / `torch.initial_seed()`", "suggest",
    "the generic calls also touch the CPU generator", "s = torch.cuda.initial_seed()"),
  R("NRN064", "rng", ("torch.cuda.default_generators",), "CUDA default generators",
    "use `torch.Generator(device=device)`", "report", "internal per-device generator list",
    "g = torch.cuda.default_generators[0]"),

  # distributed
  R("NRN070", "distributed", ("torch.distributed.init_process_group(backend@0)",
                              "torch.distributed.distributed_c10d.init_process_group(backend@0)",
                              "torch.distributed.new_group(backend=)"),
    "`\"nccl\"` backend is CUDA-only", "torch.distributed.get_default_backend_for_device(device)", "auto",
    "PyTorch maps each device type to its collective backend (gloo on CPU)",
    'dist.init_process_group("nccl")', value="nccl"),
  R("NRN071", "distributed", ("<str>",), "NCCL backend named in a string",
    "use `dist.get_default_backend_for_device(device)`", "suggest",
    "argparse defaults, comparisons and compound `\"cuda:nccl,cpu:gloo\"` specs need a decision",
    'parser.add_argument("--backend", default="nccl")', value=r"[\w:,]*\bnccl\b[\w:,]*"),
  R("NRN072", "distributed", ("torch.distributed.is_nccl_available",), "asks about NCCL only",
    "use `dist.is_backend_available(dist.get_default_backend_for_device(device))`", "suggest",
    "callers usually branch on the answer", "ok = torch.distributed.is_nccl_available()"),
  R("NRN073", "distributed", ("torch.distributed.device_mesh.init_device_mesh(device_type@0)",
                              "torch.distributed.init_device_mesh(device_type@0)",
                              "torch.distributed.device_mesh.DeviceMesh(device_type@0)",
                              "torch.distributed.tensor.DeviceMesh(device_type@0)",
                              "torch.distributed._tensor.DeviceMesh(device_type@0)"),
    "device mesh over `\"cuda\"`", "device.type", "auto", "meshes take a device-type string",
    'mesh = init_device_mesh("cuda", (2,))', value="cuda"),
  R("NRN074", "distributed", ("torch.nn.parallel.DistributedDataParallel(device_ids=)",
                              "torch.nn.parallel.distributed.DistributedDataParallel(device_ids=)"),
    "`device_ids` make DDP fail on CPU", "x if torch.accelerator.is_available() else None", "auto",
    "DDP rejects `device_ids` for CPU modules; None there, unchanged on any accelerator",
    "ddp = DDP(model, device_ids=[rank])", value="[...]"),
  R("NRN075", "distributed", ("torch.nn.parallel.DistributedDataParallel(output_device=)",
                              "torch.nn.parallel.distributed.DistributedDataParallel(output_device=)"),
    "`output_device` makes DDP fail on CPU", "x if torch.accelerator.is_available() else None", "auto",
    "DDP rejects `output_device` for CPU modules; None there, unchanged on any accelerator",
    "ddp = DDP(model, output_device=rank)", value="<index>"),
  R("NRN076", "distributed", ("torch.cuda.nccl", "torch.cuda.nccl.*", "torch.distributed.ProcessGroupNCCL"),
    "NCCL internals", "no portable equivalent", "report", "NCCL-specific", "v = torch.cuda.nccl.version()"),
  R("NRN077", "distributed", ("torch.nn.DataParallel", "torch.nn.parallel.DataParallel",
                              "torch.nn.parallel.data_parallel.DataParallel"),
    "`DataParallel` scatters over CUDA devices", "use DistributedDataParallel (one process per device)", "report",
    "single-process multi-device scatter/gather is CUDA-centric and not portable",
    "model = torch.nn.DataParallel(model)"),

  # compile modes, CUDA graphs, Triton and CUDA extensions
  R("NRN080", "compile", ("torch.compile(mode=)",), "compile mode that captures CUDA graphs",
    'use the default mode, or `mode="max-autotune-no-cudagraphs"`', "suggest",
    "dropping CUDA graphs trades speed for portability; which mode fits the target is a decision",
    'm = torch.compile(model, mode="reduce-overhead")', value="reduce-overhead|max-autotune"),
  R("NRN081", "compile", ("torch.cuda.CUDAGraph", "torch.cuda.graph", "torch.cuda.graphs.*",
                          "torch.cuda.make_graphed_callables", "torch.cuda.graph_pool_handle",
                          "torch.cuda.is_current_stream_capturing"),
    "CUDA graph capture", "use `torch.accelerator.Graph` (backend-dependent), or run eagerly", "report",
    "graph capture needs backend support that cannot be checked statically", "g = torch.cuda.CUDAGraph()"),
  R("NRN082", "extensions", ("import triton",), "Triton kernels target CUDA/ROCm GPUs",
    "use PyTorch ops, or a kernel for the target backend", "report", "hand-written GPU kernels do not port",
    "import triton"),
  R("NRN083", "extensions", ("triton.jit", "triton.autotune", "triton.heuristics"), "Triton kernel",
    "use PyTorch ops, or a kernel for the target backend", "report", "hand-written GPU kernels do not port",
    "@triton.jit\ndef kernel(x):\n    pass"),
  R("NRN084", "extensions", ("torch.utils.cpp_extension.CUDAExtension",), "CUDA C++ extension",
    "use `CppExtension` plus a kernel for the target backend", "report", "CUDA C++ sources do not port",
    'ext = torch.utils.cpp_extension.CUDAExtension("k", ["k.cu"])'),
  R("NRN085", "extensions", ("torch.utils.cpp_extension.load(extra_cuda_cflags=)",
                             "torch.utils.cpp_extension.load_inline(cuda_sources=)",
                             "torch.utils.cpp_extension.load_inline(extra_cuda_cflags=)"),
    "JIT-compiled CUDA extension", "provide a CPU or target-backend implementation", "report",
    "CUDA C++ sources do not port", 'm = torch.utils.cpp_extension.load_inline("m", "", cuda_sources=src)'),
  R("NRN086", "extensions", ("<str>",), "CUDA source file", "needs a kernel for the target backend", "report",
    "`.cu` sources need nvcc", 'sources = ["kernel.cu"]', value=r"[\w./-]+\.cuh?"),
  R("NRN087", "extensions", ("torch.cuda.jiterator", "torch.cuda.jiterator.*"), "CUDA jiterator kernel",
    "use PyTorch ops", "report", "runtime-compiled CUDA code", "f = torch.cuda.jiterator._create_jit_fn(code)"),
  R("NRN088", "extensions", ("import apex",), "NVIDIA apex", "use `torch.amp` and fused optimizers (`fused=True`)",
    "report", "apex's kernels are CUDA-only", "from apex import amp"),

  # capability and telemetry
  R("NRN090", "capability", ("torch.cuda.get_device_capability",), "CUDA compute capability",
    'use `torch.accelerator.get_device_capability()["supported_dtypes"]` (dtypes, not (major, minor))', "report",
    "SM versions have no meaning on other devices; the feature being probed needs its own check",
    "if torch.cuda.get_device_capability() >= (8, 0):\n    pass"),
  R("NRN091", "capability", ("torch.cuda.get_device_properties",), "CUDA device properties",
    "use `torch.accelerator.get_memory_info()[1]` for the total memory", "suggest",
    "only total memory has a portable counterpart", "p = torch.cuda.get_device_properties(0)"),
  R("NRN092", "capability", ("torch.cuda.get_device_name",), "CUDA device name",
    'torch.get_device_module(device).get_device_name(...) if torch.accelerator.is_available() else "cpu"', "auto",
    "the device module's name (CUDA, XPU, neuron provide it); `\"cpu\"` on CPU-only hosts. Names that feed "
    "NVIDIA peak-FLOPs tables then match none of their entries", "name = torch.cuda.get_device_name()"),
  R("NRN093", "capability", ("torch.version.cuda", "torch.version.hip", "torch.backends.cuda.is_built",
                             "torch.backends.cudnn.is_available", "torch.backends.cudnn.version"),
    "CUDA toolkit/library version query",
    "no portable equivalent; test `torch.accelerator.is_available()` or `device.type`", "report",
    "build facts about NVIDIA libraries have no portable counterpart", "v = torch.version.cuda"),
  R("NRN094", "capability", ("import pynvml", "import nvidia_smi", "import py3nvml", "<str>"),
    "NVIDIA telemetry (NVML / nvidia-smi)",
    "use `torch.accelerator.device_count()` / memory APIs, or the backend's monitoring tool", "report",
    "talks to the NVIDIA driver", 'subprocess.run(["nvidia-smi"])',
    value=r"nvidia-smi(\s.*)?"),
  R("NRN095", "capability", ("torch.cuda.utilization", "torch.cuda.temperature", "torch.cuda.power_draw",
                             "torch.cuda.clock_rate", "torch.cuda.list_gpu_processes", "torch.cuda.device_memory_used",
                             "torch.cuda.memory_usage", "torch.cuda.get_arch_list", "torch.cuda.get_gencode_flags"),
    "CUDA telemetry/build query", "use the backend's monitoring tool", "report", "NVML and nvcc facts",
    "u = torch.cuda.utilization()"),

  # profiling
  R("NRN096", "profiling", ("torch.profiler.ProfilerActivity.CUDA", "torch.autograd.ProfilerActivity.CUDA",
                            "torch._C._profiler.ProfilerActivity.CUDA"),
    "profiles CUDA kernels only", "use `torch.profiler.supported_activities()` (or `ProfilerActivity.PrivateUse1`)",
    "suggest", "which activities to record is a choice; supported_activities() adapts to the host",
    "acts = [ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]"),
  R("NRN097", "profiling", ("torch.cuda.nvtx.range",), "`torch.cuda.nvtx.range` raises on every non-CUDA build",
    "torch.profiler.record_function(...)", "auto",
    "a range of the PyTorch profiler, on every device (under `torch.autograd.profiler.emit_nvtx()` Nsight still "
    "sees it); only with a message and nothing else, since `range` formats extra arguments into it",
    'with torch.cuda.nvtx.range("forward"):\n    pass', only="one_arg"),
  R("NRN103", "profiling", ("torch.cuda.nvtx.range_push", "torch.cuda.nvtx.range_pop", "torch.cuda.nvtx.mark",
                            "torch.cuda.nvtx.range_start", "torch.cuda.nvtx.range_end"),
    "NVTX annotation: raises on every non-CUDA build",
    "if torch.cuda.is_available(): __func__(...)", "auto",
    "kept for Nsight on CUDA and skipped elsewhere (NVTX is a CUDA library; compat mode turns these into profiler "
    "ranges); the guard carries `# noqa: NRN010,NRN103` since it must stay a CUDA check",
    'torch.cuda.nvtx.range_push("step")', noqa="NRN010,NRN103"),
  R("NRN104", "profiling", ("torch.cuda.nvtx", "torch.cuda.nvtx.*"), "NVTX (Nsight only)",
    "use `with torch.profiler.record_function(name):`", "suggest",
    "record_function feeds the PyTorch profiler instead of Nsight: a different tool chain",
    "nvtx = torch.cuda.nvtx"),
  R("NRN098", "profiling", ("torch.cuda.profiler", "torch.cuda.profiler.*", "torch.cuda.cudart"),
    "CUDA profiler control", "use `torch.profiler.profile`", "report", "drives the CUDA runtime profiler",
    "torch.cuda.profiler.start()"),
  R("NRN099", "profiling", ("torch.autograd.profiler.profile(use_cuda=)", "torch.profiler.profile(use_cuda=)"),
    "`use_cuda=` profiles CUDA only", "use `activities=torch.profiler.supported_activities()`", "suggest",
    "the activity set is a choice", "with torch.autograd.profiler.profile(use_cuda=True):\n    pass"),

  # data loading and vendor ladders
  R("NRN100", "data", ("torch.utils.data.DataLoader(pin_memory_device=)",
                       "torch.utils.data.dataloader.DataLoader(pin_memory_device=)"),
    "`pin_memory_device` is deprecated and ignored", "", "auto",
    "DataLoader pins for the current accelerator; the argument only warns (removed)",
    'dl = torch.utils.data.DataLoader(ds, pin_memory=True, pin_memory_device="cuda")'),
  R("NRN105", "data", (".pin_memory()",), "`pin_memory()` raises on CPU-only hosts",
    "x.pin_memory(...) if torch.accelerator.is_available() else x", "auto",
    "pinned memory serves an accelerator; on CPU-only hosts the tensor is used as it is",
    "x = batch.pin_memory()"),
  R("NRN101", "ladder", ("<ladder>",), "vendor if/elif ladder over availability checks",
    "use `torch.accelerator.current_accelerator()` / `torch.get_device_module(device)`", "suggest",
    "collapsing branches is right only when they do the same thing for each vendor",
    'if torch.cuda.is_available():\n    d = "cuda"\nelif torch.backends.mps.is_available():\n    d = "mps"'),
  R("NRN102", "device", ("torch.cuda.*",), "other `torch.cuda` API",
    "use `torch.accelerator.*` or `torch.get_device_module(device).*`", "suggest",
    "no rule knows a portable equivalent for this name",
    "torch.cuda.ipc_collect()"),
]

RULES.sort(key=lambda r: r.code)  # the table's order; categories group them in the docs
BY_CODE: dict[str, Rule] = {r.code: r for r in RULES}
assert len(BY_CODE) == len(RULES), "duplicate rule code"

CATEGORIES = {"input": "Input", "device": "Device selection and placement", "amp": "Mixed precision",
              "backend": "Backend flags and environment", "sync": "Synchronisation, timing, streams and events",
              "memory": "Memory", "rng": "RNG and checkpoint RNG state", "distributed": "Distributed",
              "compile": "Compile modes and CUDA graphs", "extensions": "Triton and CUDA extensions",
              "capability": "Capability and telemetry", "profiling": "Profiling", "data": "Data loading",
              "ladder": "Vendor ladders"}


def shown(replacement: str) -> str:
    """A replacement as users read it: the placeholders for the call's own function and index spelled out."""
    return replacement.replace("__func__", "<the call>").replace("__index__", "i")


def markdown() -> str:
    """The catalogue as it appears in docs/migration.md (`python -m torchneuron.migrate.rules docs/migration.md`
    rewrites it there; a test keeps the two in sync)."""
    cell = lambda s: s.replace("|", "\\|").replace("\n", " ")
    out = []
    for cat, title in CATEGORIES.items():
        out += [f"### {title}", "", "| Code | Matches | Fix | Replacement | Why |", "|---|---|---|---|---|"]
        for r in (r for r in RULES if r.category == cat):
            match = ", ".join(f"`{m}`" for m in r.match) + (f" = `{r.value}`" if r.value else "")
            repl = f"`{shown(r.replacement)}`" if r.fix == "auto" and r.replacement else r.replacement or "(removed)"
            out.append(f"| {r.code} | {cell(match)} | {r.fix} | {cell(repl)} | {cell(r.why)} |")
        out.append("")
    return "\n".join(out)


DOC_BEGIN = "<!-- rules: generated by `python -m torchneuron.migrate.rules docs/migration.md` -->\n"
DOC_END = "<!-- /rules -->"


if __name__ == "__main__":
    import sys
    doc = open(sys.argv[1]).read()
    head, rest = doc.split(DOC_BEGIN)
    open(sys.argv[1], "w").write(head + DOC_BEGIN + markdown() + DOC_END + rest.split(DOC_END, 1)[1])
