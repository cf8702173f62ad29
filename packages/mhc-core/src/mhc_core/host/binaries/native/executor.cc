// The per-call host path of every fused op: validate and launch, in C++ behind TVM-FFI.
//
// An op builds one `Program` per call form at construction (`mhc_core.host.calls.programs` describes
// it in Python and passes it here once): the per-call parameters and their rules, the outputs,
// and the kernels to launch with each argument's source. A call is then one TVM-FFI call with
// torch tensors, which TVM-FFI hands over as DLTensors (C-level DLPack exchange), with torch's
// current stream set for the call's device. The outputs come allocated by the caller (torch
// allocates them in Python: tensors torch owns, whose storages `record_stream`, CUDA graphs'
// pools and resizing treat as their own; a tensor allocated here would come back through DLPack
// as a foreign storage):
//
//   1. every parameter is checked (dtype, shape with the token count M / MoE rows bound from
//      their leading extents, device, contiguity as torch defines it or an output's own strides,
//      alignment; scalars normal FP32 values > 0), and the outputs' memory against the
//      parameters' and each other's: an output may be one of the parameters its rule names (the
//      same bytes exactly: in place), and overlaps nothing else (not checked when the flags say
//      the op allocated them for this call). An output's memory is its view, or the storage its
//      rule gives (the FP8 scale layouts' padding rows lie past the view). Nothing is launched
//      before all pass. A failing call raises a
//      ValueError whose message starts "mhc-invalid"; the Python side then runs the same rules
//      with the project's messages (`mhc_core.host.calls.rules.check_call`), so the rules live in one
//      declaration and the messages in one place;
//   2. the launches run in order on the current stream or the op's side stream. The side stream
//      forks off the current one (one reused event) right before the launch marked forks_side,
//      else right before the first side launch; a join event, when
//      given, is waited on first; a side event, when given, is recorded after the last launch,
//      and the op's done event (what a call on another stream waits for) after that;
//   3. it returns the token count M. A check-only call (the two-phase form's plan) stops after
//      the checks; it may pass None for every output.
//
// Events go through the CUDA driver API (libcuda, loaded once). A program for another device
// type (CPU: the host-wiring tests, whose kernels are recorders) uses no events.

#include <dlfcn.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>  // TVMFFIEnvGetStream
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <array>
#include <cfloat>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mhc {
namespace ffi = tvm::ffi;

// ------------------------------------------------------------------ the program's description
// An extent, stride or storage size: `times` (base 0), or align(M or rows, to) * times.
struct Dim {
  enum Base : int64_t { kLiteral = 0, kM = 1, kRows = 2 };
  int64_t base = kLiteral;
  int64_t to = 1;
  int64_t times = 0;

  int64_t resolve(int64_t m, int64_t rows) const {
    if (base == kLiteral) return times;
    const int64_t count = base == kM ? m : rows;
    return (count + to - 1) / to * to * times;
  }
};

// Where a kernel argument comes from.
enum Source : int64_t {
  kFixed = 0,    // a value bound at construction (an int, a float, a persistent buffer)
  kPointer = 1,  // the data pointer of parameter or output `index` (outputs follow parameters)
  kDim = 2,      // M (index 0) or rows (index 1)
  kScalar = 3,   // the value of scalar parameter `index`
  kFlag = 4,     // a per-call flag: index 0 = after_publish
  kStream = 5,   // index 0 = the current stream, 1 = the op's side stream
};

// Per-call flags (the `flags` argument).
constexpr int64_t kCheckOnly = 1;
constexpr int64_t kAfterPublish = 2;
constexpr int64_t kJoinExternal = 4;  // the join event was recorded outside the capture
constexpr int64_t kRecordDone = 8;    // record the op's done event on the current stream at the end
constexpr int64_t kFreshOutputs = 16;  // the op allocated the outputs for this call: they overlap nothing
// Parameters plus outputs a program may take (a call's check keeps them on the stack, not the heap).
constexpr size_t kMaxArgs = 32;

struct Rule {
  bool tensor = true;  // else a scalar: a finite float or int > 0
  std::vector<DLDataType> dtypes;
  std::vector<std::vector<Dim>> shapes;
  int64_t align = 16;  // 0: the dtype's size
  bool binds_m = false;
  bool binds_rows = false;
  std::vector<int64_t> aliases;  // an output's: the parameters it may be exactly (in place)
  std::vector<Dim> strides;      // an output's strides; empty: contiguous
  std::optional<Dim> storage;    // an output's elements written from its first, past its view
};

struct Arg {
  Source source;
  int64_t index;
  ffi::Any fixed;
};

struct Launch {
  int64_t stream;                       // 0 current, 1 side
  bool forks_side;                      // the side stream forks right before this launch
  std::vector<ffi::Function> variants;  // by token count: variant i serves M >= min_tokens[i]
  std::vector<int64_t> min_tokens;
  std::vector<int64_t> enabled;  // per variant, 0: nothing launches (the other protocol's M); empty: all
  std::vector<Arg> args;
};

struct Program {
  std::vector<Rule> rules;
  std::vector<Rule> outputs;  // one dtype, one shape each: what a given output is checked against
  std::vector<Launch> launches;
  DLDevice device;
  int64_t capacity;
  void* side_stream;
  void* fork_event;
  void* done_event;
};

// ------------------------------------------------------------------------- the driver API
struct Driver {
  using Record = int (*)(void*, void*);
  using Wait = int (*)(void*, void*, unsigned);
  Record record = nullptr;
  Wait wait = nullptr;

  static const Driver& get() {
    static const Driver driver = [] {
      Driver d;
      void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
      if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
      if (lib != nullptr) {
        d.record = reinterpret_cast<Record>(dlsym(lib, "cuEventRecord"));
        d.wait = reinterpret_cast<Wait>(dlsym(lib, "cuStreamWaitEvent"));
      }
      return d;
    }();
    return driver;
  }

  static void check(int status, const char* what) {
    if (status != 0) TVM_FFI_THROW(RuntimeError) << "mhc: " << what << " failed with CUDA error " << status;
  }

  static void record_on(void* event, void* stream) {
    const Driver& d = get();
    if (d.record == nullptr) TVM_FFI_THROW(RuntimeError) << "mhc: libcuda.so.1 has no cuEventRecord";
    check(d.record(event, stream), "cuEventRecord");
  }

  static void wait_on(void* stream, void* event, unsigned flags) {
    const Driver& d = get();
    if (d.wait == nullptr) TVM_FFI_THROW(RuntimeError) << "mhc: libcuda.so.1 has no cuStreamWaitEvent";
    check(d.wait(stream, event, flags), "cuStreamWaitEvent");
  }
};

// ------------------------------------------------------------------------------ checking
[[noreturn]] void reject(int index, const char* why) {
  TVM_FFI_THROW(ValueError) << "mhc-invalid: argument " << index << ": " << why;
}

bool same_dtype(DLDataType a, DLDataType b) { return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes; }

// torch's is_contiguous: every dimension of extent != 1 has the compact stride; empty is contiguous.
bool contiguous(const DLTensor* t) {
  if (t->strides == nullptr) return true;
  int64_t expected = 1;
  for (int d = t->ndim - 1; d >= 0; --d) {
    int64_t extent = t->shape[d];
    if (extent == 0) return true;
    if (extent != 1) {
      if (t->strides[d] != expected) return false;
      expected *= extent;
    }
  }
  return true;
}

bool shape_matches(const DLTensor* t, const std::vector<Dim>& shape, int64_t m, int64_t rows) {
  if (t->ndim != static_cast<int>(shape.size())) return false;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (t->shape[d] != shape[d].resolve(m, rows)) return false;
  }
  return true;
}

// Dimension d's stride (DLPack's null strides: compact row-major).
int64_t stride(const DLTensor* t, int d) {
  if (t->strides != nullptr) return t->strides[d];
  int64_t compact = 1;
  for (int e = d + 1; e < t->ndim; ++e) compact *= t->shape[e];
  return compact;
}

// As torch's contiguity: every dimension of extent != 1 has the given stride (the shape matched).
bool strides_match(const DLTensor* t, const std::vector<Dim>& strides, int64_t m, int64_t rows) {
  for (int d = 0; d < t->ndim; ++d) {
    if (t->shape[d] != 1 && stride(t, d) != strides[static_cast<size_t>(d)].resolve(m, rows)) return false;
  }
  return true;
}

void check_tensor(int index, const DLTensor* t, const Rule& rule, const DLDevice& device, int64_t m, int64_t rows) {
  bool dtype_ok = false;
  for (const DLDataType& dtype : rule.dtypes) dtype_ok = dtype_ok || same_dtype(dtype, t->dtype);
  if (!dtype_ok) reject(index, "dtype");
  bool shape_ok = false;
  for (const auto& shape : rule.shapes) shape_ok = shape_ok || shape_matches(t, shape, m, rows);
  if (!shape_ok) reject(index, "shape");
  // torch reports pinned host memory as a CPU tensor: only an exact device match passes.
  if (t->device.device_type != device.device_type || t->device.device_id != device.device_id) {
    reject(index, "device");
  }
  if (rule.strides.empty() && !contiguous(t)) reject(index, "contiguity");
  if (!rule.strides.empty() && !strides_match(t, rule.strides, m, rows)) reject(index, "strides");
  int64_t align = rule.align ? rule.align : (t->dtype.bits * t->dtype.lanes + 7) / 8;
  auto address = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
  if (address % static_cast<uintptr_t>(align)) reject(index, "alignment");
}

std::optional<DLTensor*> as_tensor(const ffi::AnyView& value) { return value.try_cast<DLTensor*>(); }

// The bytes a checked (contiguous) tensor spans: [first, last).
struct Span {
  uintptr_t first, last;
  bool overlaps(const Span& other) const { return first < other.last && other.first < last; }
  bool operator==(const Span& other) const { return first == other.first && last == other.last; }
};

// A checked tensor's view (contiguous, or with its rule's strides), or its rule's storage.
Span span(const DLTensor* t, const Rule& rule, int64_t m, int64_t rows) {
  int64_t elements = 1;
  if (rule.storage) {
    elements = rule.storage->resolve(m, rows);
  } else if (!rule.strides.empty()) {
    for (int d = 0; d < t->ndim; ++d) {
      if (t->shape[d] == 0) elements = 0;
    }
    for (int d = 0; d < t->ndim && elements; ++d) elements += (t->shape[d] - 1) * stride(t, d);
  } else {
    for (int d = 0; d < t->ndim; ++d) elements *= t->shape[d];
  }
  uintptr_t first = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
  return Span{first, first + static_cast<uintptr_t>(elements * ((t->dtype.bits * t->dtype.lanes + 7) / 8))};
}

// ------------------------------------------------------------------------------ the call
struct Call {
  const Program& program;
  int64_t m = -1;
  int64_t rows = -1;
  std::array<const DLTensor*, kMaxArgs> tensors{};  // parameters then outputs (nullptr for scalars)
  std::array<double, kMaxArgs> scalars{};           // by parameter index

  explicit Call(const Program& p) : program(p) {}

  // Every parameter and output is valid; M (and rows) bound. `m_given` >= 0: the pending
  // publish's M (a collect), which the parameters must match. `check_only`: outputs may be None.
  // `fresh_outputs`: the op allocated the outputs for this call (nothing to check their memory against).
  void check(const ffi::PackedArgs& args, int first, int64_t m_given, bool check_only, bool fresh_outputs) {
    const size_t n_rules = program.rules.size();
    const size_t n_outputs = program.outputs.size();
    if (static_cast<size_t>(args.size() - first) != n_rules + n_outputs) {
      TVM_FFI_THROW(TypeError) << "mhc: expected " << n_rules + n_outputs << " per-call arguments, got "
                               << args.size() - first;
    }
    m = m_given;
    for (size_t i = 0; i < n_rules; ++i) {
      const Rule& rule = program.rules[i];
      const ffi::AnyView value = args[first + static_cast<int>(i)];
      if (!rule.tensor) {
        double scalar;
        if (auto f = value.try_cast<double>(); f && value.type_index() == ffi::TypeIndex::kTVMFFIFloat) {
          scalar = *f;
        } else if (value.type_index() == ffi::TypeIndex::kTVMFFIInt) {
          scalar = static_cast<double>(value.cast<int64_t>());
        } else {
          reject(static_cast<int>(i), "not a float");
        }
        // The kernels take scalars as FP32: a value that rounds to a subnormal, zero or inf there is refused.
        if (!(scalar >= FLT_MIN && scalar <= FLT_MAX)) reject(static_cast<int>(i), "not a normal FP32 > 0");
        scalars[i] = scalar;
        continue;
      }
      auto tensor = as_tensor(value);
      if (!tensor) reject(static_cast<int>(i), "not a tensor");
      const DLTensor* t = *tensor;
      if (rule.binds_m && m < 0) {  // the first tensor led by M binds it; later ones must match
        if (t->ndim == 0) reject(static_cast<int>(i), "no leading dimension");
        m = t->shape[0];
        if (m < 1 || m > program.capacity) reject(static_cast<int>(i), "token count");
      }
      if (rule.binds_rows && rows < 0) {
        if (t->ndim == 0) reject(static_cast<int>(i), "no leading dimension");
        rows = t->shape[0];
      }
      check_tensor(static_cast<int>(i), t, rule, program.device, m, rows);
      tensors[i] = t;
    }
    if (m < 1) TVM_FFI_THROW(TypeError) << "mhc: no parameter gives the token count";
    for (size_t o = 0; o < n_outputs; ++o) {
      const ffi::AnyView value = args[first + static_cast<int>(n_rules + o)];
      const int index = static_cast<int>(n_rules + o);
      if (check_only && value.type_index() == ffi::TypeIndex::kTVMFFINone) continue;
      auto tensor = as_tensor(value);
      if (!tensor) reject(index, "not a tensor");
      check_tensor(index, *tensor, program.outputs[o], program.device, m, rows);
      tensors[n_rules + o] = *tensor;
    }
    if (!fresh_outputs) check_overlaps(n_rules);
  }

  // Each given output overlaps no parameter but one its rule names, and then exactly, and no
  // other output.
  void check_overlaps(size_t n_rules) const {
    const size_t n = n_rules + program.outputs.size();
    std::array<Span, kMaxArgs> spans{};  // each tensor's once (empty for scalars and absent outputs)
    for (size_t i = 0; i < n; ++i) {
      if (tensors[i] == nullptr) continue;
      spans[i] = span(tensors[i], i < n_rules ? program.rules[i] : program.outputs[i - n_rules], m, rows);
    }
    for (size_t o = n_rules; o < n; ++o) {
      const Span mine = spans[o];
      if (mine.first == mine.last) continue;
      const std::vector<int64_t>& aliases = program.outputs[o - n_rules].aliases;
      for (size_t i = 0; i < o; ++i) {  // the parameters, then the outputs before this one
        if (!mine.overlaps(spans[i])) continue;
        bool in_place = false;
        for (int64_t alias : aliases) in_place = in_place || static_cast<size_t>(alias) == i;
        if (!(in_place && mine == spans[i])) reject(static_cast<int>(o), "overlap");
      }
    }
  }

  void launch(int64_t flags, int64_t variant, void* stream) {
    bool forked = false;
    std::vector<ffi::AnyView> values;
    for (const Launch& launch : program.launches) {
      void* on = launch.stream == 1 ? program.side_stream : stream;
      size_t chosen = 0;
      if (variant >= 0 && launch.variants.size() > 1) {  // a forced kernel (the warm-up's)
        if (static_cast<size_t>(variant) >= launch.variants.size()) {
          TVM_FFI_THROW(IndexError) << "mhc: variant " << variant << " of " << launch.variants.size();
        }
        chosen = static_cast<size_t>(variant);
      } else {
        for (size_t v = 0; v < launch.min_tokens.size(); ++v) {
          if (m >= launch.min_tokens[v]) chosen = v;
        }
      }
      if (!launch.enabled.empty() && launch.enabled[chosen] == 0) continue;  // the other protocol's launch
      if ((launch.forks_side || launch.stream == 1) && !forked && program.fork_event != nullptr) {
        // The side kernel waits for what precedes this point on the current stream, not longer:
        // forked before the launch that says so (GLM's boundary), else before the side launch.
        Driver::record_on(program.fork_event, stream);
        Driver::wait_on(program.side_stream, program.fork_event, 0);
        forked = true;
      }
      values.clear();
      for (const Arg& arg : launch.args) {
        switch (arg.source) {
          case kFixed:
            values.emplace_back(arg.fixed);
            break;
          case kPointer: {
            const DLTensor* t = tensors[static_cast<size_t>(arg.index)];
            values.emplace_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t->data) + t->byte_offset));
            break;
          }
          case kDim:
            values.emplace_back(arg.index == 0 ? m : rows);
            break;
          case kScalar:
            values.emplace_back(scalars[static_cast<size_t>(arg.index)]);
            break;
          case kFlag:
            values.emplace_back(static_cast<int64_t>((flags & kAfterPublish) != 0));
            break;
          case kStream:
            values.emplace_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(arg.index == 1 ? program.side_stream : on)));
            break;
        }
      }
      ffi::Any ignored;
      launch.variants[chosen].CallPacked(values.data(), static_cast<int32_t>(values.size()), &ignored);
    }
  }
};

// --------------------------------------------------------------------------- building
DLDataType to_dtype(const ffi::Array<int64_t>& code_bits) {
  return DLDataType{static_cast<uint8_t>(code_bits[0]), static_cast<uint8_t>(code_bits[1]), 1};
}

std::vector<int64_t> to_ints(const ffi::Array<int64_t>& values) {
  return std::vector<int64_t>(values.begin(), values.end());
}

// [base, to, times] per dimension, flat (`mhc_core.host.calls.programs._shape`).
std::vector<Dim> to_shape(const ffi::Array<int64_t>& numbers) {
  if (numbers.size() % 3) TVM_FFI_THROW(ValueError) << "mhc: a shape takes three numbers per dimension";
  std::vector<Dim> dims;
  for (size_t i = 0; i < numbers.size(); i += 3) {
    dims.push_back(Dim{numbers[i], numbers[i + 1], numbers[i + 2]});
    if (dims.back().to < 1) TVM_FFI_THROW(ValueError) << "mhc: a dimension aligned to " << dims.back().to;
  }
  return dims;
}

// `rules`: [tensor?, align, binds_m?, binds_rows?, [[code, bits] ...], [shape ...]] per parameter, a
// shape three numbers per dimension (`to_shape`). `outputs`: [[code, bits], shape, [parameter it may
// alias ...], strides (empty: contiguous), storage (empty, or one dimension's three)] per output. `launches`: [stream, forks_side,
// [min_tokens ...], [function ...], [[source, index, fixed] ...], [enabled ...]] per launch (enabled: one
// flag per variant, or empty for all). `device`: [device_type, device_id].
// `events`: [side_stream, fork_event, done_event] (raw handles; 0: none).
ffi::Function make_program(ffi::Array<ffi::Array<ffi::Any>> rules, ffi::Array<ffi::Array<ffi::Any>> outputs,
                           ffi::Array<ffi::Array<ffi::Any>> launches, ffi::Array<int64_t> device, int64_t capacity,
                           ffi::Array<int64_t> events) {
  if (rules.size() + outputs.size() > kMaxArgs) {
    TVM_FFI_THROW(ValueError) << "mhc: a program takes at most " << kMaxArgs << " parameters and outputs, got "
                              << rules.size() + outputs.size();
  }
  auto program = std::make_shared<Program>();
  for (const auto& r : rules) {
    Rule rule;
    rule.tensor = r[0].cast<bool>();
    rule.align = r[1].cast<int64_t>();
    rule.binds_m = r[2].cast<bool>();
    rule.binds_rows = r[3].cast<bool>();
    for (const auto& dtype : r[4].cast<ffi::Array<ffi::Array<int64_t>>>()) rule.dtypes.push_back(to_dtype(dtype));
    for (const auto& shape : r[5].cast<ffi::Array<ffi::Array<int64_t>>>()) rule.shapes.push_back(to_shape(shape));
    program->rules.push_back(std::move(rule));
  }
  for (const auto& o : outputs) {
    Rule rule;
    rule.dtypes = {to_dtype(o[0].cast<ffi::Array<int64_t>>())};
    rule.shapes = {to_shape(o[1].cast<ffi::Array<int64_t>>())};
    rule.aliases = to_ints(o[2].cast<ffi::Array<int64_t>>());
    rule.strides = to_shape(o[3].cast<ffi::Array<int64_t>>());
    if (!rule.strides.empty() && rule.strides.size() != rule.shapes[0].size()) {
      TVM_FFI_THROW(ValueError) << "mhc: an output's strides need one entry per dimension";
    }
    const std::vector<Dim> storage = to_shape(o[4].cast<ffi::Array<int64_t>>());
    if (storage.size() > 1) TVM_FFI_THROW(ValueError) << "mhc: an output's storage is one dimension";
    if (!storage.empty()) rule.storage = storage[0];
    program->outputs.push_back(std::move(rule));
  }
  for (const auto& l : launches) {
    Launch launch;
    launch.stream = l[0].cast<int64_t>();
    launch.forks_side = l[1].cast<int64_t>() != 0;
    launch.min_tokens = to_ints(l[2].cast<ffi::Array<int64_t>>());
    for (const auto& f : l[3].cast<ffi::Array<ffi::Function>>()) launch.variants.push_back(f);
    if (launch.variants.empty() || launch.variants.size() != launch.min_tokens.size()) {
      TVM_FFI_THROW(ValueError) << "mhc: a launch needs one min_tokens entry per variant";
    }
    for (const auto& a : l[4].cast<ffi::Array<ffi::Array<ffi::Any>>>()) {
      launch.args.push_back(Arg{static_cast<Source>(a[0].cast<int64_t>()), a[1].cast<int64_t>(), a[2]});
    }
    if (l.size() > 5) launch.enabled = to_ints(l[5].cast<ffi::Array<int64_t>>());
    if (!launch.enabled.empty() && launch.enabled.size() != launch.variants.size()) {
      TVM_FFI_THROW(ValueError) << "mhc: a launch needs one enabled flag per variant";
    }
    program->launches.push_back(std::move(launch));
  }
  program->device = DLDevice{static_cast<DLDeviceType>(device[0]), static_cast<int32_t>(device[1])};
  program->capacity = capacity;
  program->side_stream = reinterpret_cast<void*>(static_cast<uintptr_t>(events[0]));
  program->fork_event = reinterpret_cast<void*>(static_cast<uintptr_t>(events[1]));
  program->done_event = reinterpret_cast<void*>(static_cast<uintptr_t>(events[2]));

  // program(flags, m_given, variant, join_event, side_event, *parameters, *outputs). TVM-FFI takes
  // the call's stream from the first CUDA tensor (all are on the op's device, or the call fails).
  return ffi::Function::FromPacked([program](ffi::PackedArgs args, ffi::Any* rv) {
    constexpr int kFirst = 5;
    if (args.size() < kFirst) TVM_FFI_THROW(TypeError) << "mhc: a program call takes at least 5 arguments";
    const int64_t flags = args[0].cast<int64_t>();
    const int64_t m_given = args[1].cast<int64_t>();
    const int64_t variant = args[2].cast<int64_t>();
    void* join_event = reinterpret_cast<void*>(static_cast<uintptr_t>(args[3].cast<int64_t>()));
    void* side_event = reinterpret_cast<void*>(static_cast<uintptr_t>(args[4].cast<int64_t>()));
    Call call(*program);
    call.check(args, kFirst, m_given, (flags & kCheckOnly) != 0, (flags & kFreshOutputs) != 0);
    *rv = call.m;
    if (flags & kCheckOnly) return;
    const bool cuda = program->device.device_type == kDLCUDA;
    void* stream = cuda ? TVMFFIEnvGetStream(kDLCUDA, program->device.device_id) : nullptr;
    if (join_event != nullptr && cuda) Driver::wait_on(stream, join_event, (flags & kJoinExternal) ? 1u : 0u);
    call.launch(flags, variant, stream);
    if (side_event != nullptr && cuda) Driver::record_on(side_event, program->side_stream);
    if ((flags & kRecordDone) && program->done_event != nullptr && cuda) Driver::record_on(program->done_event, stream);
  });
}

#ifndef MHC_SOURCE_DIGEST
#define MHC_SOURCE_DIGEST "unknown"
#endif

// The digest of the source and flags this library was built from (`mhc_core.host.binaries.native.digest`).
ffi::String source_digest() { return MHC_SOURCE_DIGEST; }

}  // namespace mhc

TVM_FFI_DLL_EXPORT_TYPED_FUNC(make_program, mhc::make_program);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(source_digest, mhc::source_digest);
