// splitgrad._C: the Python face of the deferred-wgrad store and the grad-ready hooks. The ops
// themselves are not bound here: they are registered with the dispatcher (torch.ops.splitgrad.*).
#include <c10/util/accumulate.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include "ops/checks.h"
#include "ops/deferred_internal.h"
#include "splitgrad/deferred.h"

namespace py = pybind11;

namespace {

// HANDLE_TH_ERRORS / END_HANDLE_TH_ERRORS_PYBIND (torch/csrc/Exceptions.h) map c10 errors to
// Python's ValueError / TypeError / RuntimeError and turn C++ warnings into Python warnings.

// Holds the GIL for a scope with the plain CPython API, which nests safely whoever holds it:
// pybind11's gil_scoped_* keep their own thread-state bookkeeping per pybind11 build, and mixing
// ours with libtorch_python's crashed on Python 3.12.
class GilHeld {
 public:
  GilHeld() : state_(PyGILState_Ensure()) {}
  ~GilHeld() { PyGILState_Release(state_); }
  GilHeld(const GilHeld&) = delete;
  GilHeld& operator=(const GilHeld&) = delete;

 private:
  PyGILState_STATE state_;
};

// Rethrows the Python exception being handled as a python_error, which carries it (type included)
// through autograd's threads and back to the caller, as torch's own hooks do.
[[noreturn]] void rethrow_python_error(py::error_already_set& error) {
  error.restore();
  python_error persisted;
  persisted.persist();
  throw persisted;
}

// Runs a Python callable from C++ (hooks fire from backward_dw() or autograd's threads).
template <typename... Args>
std::function<void(Args...)> python_callback(py::function fn) {
  auto shared = std::shared_ptr<py::function>(new py::function(std::move(fn)), [](py::function* f) {
    if (!Py_IsInitialized()) return;  // at exit, after the interpreter: leak rather than crash
    GilHeld gil;
    delete f;
  });
  return [shared](Args... args) {
    GilHeld gil;
    try {
      (*shared)(args...);
    } catch (py::error_already_set& error) {
      rethrow_python_error(error);
    }
  };
}

// The main_grads a lazy_main_grad layer's backward reads (src/ops/deferred.cpp), where Transformer
// Engine's backward reads them: `param.get_main_grad()` for a Megatron-FSDP parameter (which
// allocates its main_grad only before the backward), else `param.main_grad`; a parameter with
// neither gets the buffer of splitgrad::set_main_grad(), if any.
std::vector<at::Tensor> python_main_grads(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> buffers(params.size());
  if (!Py_IsInitialized()) return buffers;  // at exit
  GilHeld gil;
  try {
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].defined()) continue;
      const py::object param = py::cast(params[i]);
      const py::object buffer =
          py::hasattr(param, "__fsdp_param__") && py::hasattr(param, "get_main_grad")
              ? param.attr("get_main_grad")()
              : py::getattr(param, "main_grad", py::none());
      if (buffer.is_none()) {
        buffers[i] = splitgrad::main_grad(params[i]);
      } else {
        TORCH_CHECK_TYPE(THPVariable_Check(buffer.ptr()),
                         "expected a parameter's main_grad to be a torch.Tensor, got ",
                         Py_TYPE(buffer.ptr())->tp_name, " (a parameter of shape ",
                         params[i].sizes(), ")");
        buffers[i] = THPVariable_Unpack(buffer.ptr());
      }
    }
  } catch (py::error_already_set& error) {
    rethrow_python_error(error);
  }
  return buffers;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "splitgrad's C++ core: the deferred-wgrad store and grad-ready hooks";

  // backward_dw() takes and drops its parameters' references in batches: with the GIL held for a
  // batch, PyTorch's per-tensor GIL round trips for Python-owned tensors are cheap re-entries.
  splitgrad::detail::set_reference_batch_hook([]() -> std::shared_ptr<void> {
    if (!Py_IsInitialized()) return nullptr;  // as PyTorch's own reference counting checks
    return std::make_shared<GilHeld>();       // not pybind11's: see GilHeld
  });
  splitgrad::detail::set_main_grad_source(&python_main_grads);

  py::class_<splitgrad::LayerHandle, std::shared_ptr<splitgrad::LayerHandle>>(m, "LayerHandle")
      .def(py::init<std::string>(), py::arg("name"))
      .def_property_readonly("id", &splitgrad::LayerHandle::id)
      .def_property("name", &splitgrad::LayerHandle::name, &splitgrad::LayerHandle::set_name)
      .def("pending", &splitgrad::LayerHandle::pending)
      .def("release", &splitgrad::LayerHandle::release)
      .def("backward_dw",
           [](splitgrad::LayerHandle& self) {
             HANDLE_TH_ERRORS
             // It may wait for another thread running this layer's work, which needs the GIL
             // (hooks, and freeing stashed tensors that had Python objects).
             py::gil_scoped_release no_gil;
             self.backward_dw();
             END_HANDLE_TH_ERRORS_PYBIND
           })
      .def("pending_passes", &splitgrad::LayerHandle::pending_passes)
      .def_property_readonly("ran_untracked", &splitgrad::LayerHandle::ran_untracked)
      .def("note_ran_untracked", &splitgrad::LayerHandle::note_ran_untracked)
      .def(
          "backward_dw_pass",
          [](splitgrad::LayerHandle& self, int64_t pass) {
            HANDLE_TH_ERRORS
            py::gil_scoped_release no_gil;  // as backward_dw()
            self.backward_dw(pass);
            END_HANDLE_TH_ERRORS_PYBIND
          },
          py::arg("pass_id"))
      // A copied layer is a new layer: it gets its own registration (and no pending work).
      .def("__deepcopy__",
           [](const splitgrad::LayerHandle& self, py::dict) {
             return std::make_shared<splitgrad::LayerHandle>(self.name());
           })
      .def(py::pickle(
          [](const splitgrad::LayerHandle& self) { return py::make_tuple(self.name()); },
          [](py::tuple state) {
            return std::make_shared<splitgrad::LayerHandle>(state[0].cast<std::string>());
          }));

  py::class_<splitgrad::GradReadyHookHandle>(m, "GradReadyHookHandle")
      .def("remove", &splitgrad::GradReadyHookHandle::remove)
      .def_property_readonly("active", &splitgrad::GradReadyHookHandle::active);

  m.def(
      "backward_dw_all",
      [](const std::vector<at::Tensor>& params) {
        HANDLE_TH_ERRORS
        // It may wait for another thread's deferred work, whose hooks need the GIL.
        py::gil_scoped_release no_gil;
        splitgrad::backward_dw_all(params);
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("params") = std::vector<at::Tensor>{},
      "Runs the pending deferred wgrad feeding `params` (every item when empty), oldest first.");
  m.def("pending_wgrads", &splitgrad::pending_wgrads,
        "How many deferred wgrad items are waiting (all layers).");
  m.def(
      "pending_wgrads_for",
      [](const at::Tensor& param) {
        HANDLE_TH_ERRORS
        return splitgrad::pending_wgrads_for(param);
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("param"), "Deferred contributions still owed to param (queued, not yet landed).");
  m.def(
      "dropped_wgrads_for",
      [](const at::Tensor& param) {
        HANDLE_TH_ERRORS
        return splitgrad::dropped_wgrads_for(param);
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("param"), "Deferred contributions to param dropped so far.");
  m.def("layers_with_pending_wgrads", &splitgrad::layers_with_pending_wgrads,
        py::arg("params") = std::vector<at::Tensor>{});
  m.def(
      "check_linear_args",
      [](int64_t layer_id, const at::Tensor& input, const at::Tensor& weight,
         const std::optional<at::Tensor>& bias, std::optional<at::ScalarType> compute_dtype) {
        HANDLE_TH_ERRORS
        splitgrad::detail::check_linear_args(
            [&] { return splitgrad::detail::layer_label(layer_id); }, input, weight, bias,
            compute_dtype);
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("layer_id"), py::arg("input"), py::arg("weight"), py::arg("bias"),
      py::arg("compute_dtype") = std::nullopt,
      "The op's argument checks, for a forward that runs without the op (torch.func transforms).");
  m.def(
      "check_grouped_linear_args",
      [](int64_t layer_id, const at::Tensor& input, const at::Tensor& m_splits,
         const std::vector<int64_t>& split_sizes, const std::vector<at::Tensor>& weights,
         const std::vector<at::Tensor>& biases, std::optional<at::ScalarType> compute_dtype) {
        HANDLE_TH_ERRORS
        auto who = [&] { return splitgrad::detail::layer_label(layer_id); };
        splitgrad::detail::check_grouped_linear_args(who, input, m_splits, weights, biases,
                                                     /*splits_on_cpu_only=*/false, compute_dtype);
        // The rows: the input's leading dimensions (it has at least one, checked above; its last
        // may be 0 where a substituted weight has no in_features).
        const auto sizes = input.sizes();
        splitgrad::detail::check_split_sizes(
            who, split_sizes, c10::multiply_integers(sizes.begin(), sizes.end() - 1));
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("layer_id"), py::arg("input"), py::arg("m_splits"), py::arg("split_sizes"),
      py::arg("weights"), py::arg("biases"), py::arg("compute_dtype") = std::nullopt,
      "The grouped op's argument checks, for a forward that runs without the op (torch.func "
      "transforms, whose tensors may have no storage): m_splits' values are given read "
      "(split_sizes).");
  m.def(
      "check_gemm_args",
      [](int64_t layer_id, const std::string& gemm, const at::Tensor& input,
         const at::Tensor& weight, const std::optional<at::Tensor>& bias,
         const std::optional<at::Tensor>& weight_main_grad,
         const std::optional<at::Tensor>& bias_main_grad, const std::string& weight_name,
         const std::string& bias_name, std::optional<at::ScalarType> compute_dtype,
         const std::optional<std::string>& input_activation) {
        HANDLE_TH_ERRORS
        auto who = [&] { return splitgrad::detail::layer_label(layer_id, gemm); };
        splitgrad::detail::check_gemm_args(
            who,
            input_activation.has_value()
                ? splitgrad::detail::activation_gemm_input(who, input, *input_activation, weight)
                : input,
            weight, bias, weight_main_grad, bias_main_grad, weight_name, bias_name, compute_dtype);
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("layer_id"), py::arg("gemm"), py::arg("input"), py::arg("weight"), py::arg("bias"),
      py::arg("weight_main_grad"), py::arg("bias_main_grad"), py::arg("weight_name"),
      py::arg("bias_name"), py::arg("compute_dtype") = std::nullopt,
      py::arg("input_activation") = std::nullopt,
      "The op's checks of one GEMM of a module, in messages naming the module and the GEMM "
      "(\"splitgrad layer 'mlp' (fc2)\") and its parameters; with input_activation, `input` is "
      "that activation's input (as for the linear op).");
  m.def(
      "check_main_grad",
      [](int64_t layer_id, const std::string& gemm, const std::string& param_name,
         const at::Tensor& main_grad, const at::Tensor& param) {
        HANDLE_TH_ERRORS
        splitgrad::detail::check_main_grad(
            [&] { return splitgrad::detail::layer_label(layer_id, gemm); }, param_name, main_grad,
            param);
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("layer_id"), py::arg("gemm"), py::arg("param_name"), py::arg("main_grad"),
      py::arg("param"),
      "The op's check of a main_grad (fp32, the parameter's shape and device), for a forward whose "
      "backward reads it (lazy_main_grad).");
  m.def(
      "register_grad_ready_hook",
      [](const at::Tensor& param, py::function fn) {
        HANDLE_TH_ERRORS
        return splitgrad::register_grad_ready_hook(param, python_callback<const at::Tensor&>(fn));
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("param"), py::arg("hook"));
  m.def("grad_ready_pass", &splitgrad::grad_ready_pass,
        "Inside a grad-ready hook, the id of the backward pass it reports on; else None.");
  m.def("grad_ready_layer_ran", &splitgrad::grad_ready_layer_ran, py::arg("layer_id"),
        "Inside a grad-ready hook, whether the layer's ops ran their backward in that pass; None "
        "if no splitgrad layer's did, and outside a hook.");
}
