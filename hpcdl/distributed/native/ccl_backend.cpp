// The oneCCL group's small all-reduce without a call into Python: a c10d Backend in C++ whose allreduce queues
// onecclAllReduce on c_comm_thread's C thread and returns a Work that waits in C.
//
// hpcdl/distributed/native/build.py builds this file with torch's own tooling (torch.utils.cpp_extension) against the
// torch it runs with; hpcdl/distributed/native/ccl_backend.py imports it. FastBackend derives from torch's trampoline
// for Python backends (c10d::PyBackend, a header since torch 2.14), so the Python group
// (hpcdl.distributed.ccl.group.CCLProcessGroup, which subclasses it) keeps every other collective: only an
// all-reduce that fits the fast path stays here, and any other one goes on to the Python group's allreduce. What
// needs judgement stays in Python and is asked only off the fast path, by the names of ccl_backend.py's
// BackendCallbacks (a test reads them from the ask("...") and attr("...") calls below): whether a long wait has
// outlived the group's timeout or lost a peer (ticket_overdue), the words for a oneCCL error (ticket_error), and a
// future for a caller that asks for one (ticket_future).
//
// The fc_* functions come from c_comm_thread.c's library (libhpcdl_c_comm_thread.so), which this extension is linked
// against (build.py: its path on the link line and its folder as rpath): whichever of the two is loaded first, the
// process holds one copy of it.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/distributed/c10d/exception.h>
#include <torch/csrc/distributed/c10d/py/PyBackend.hpp>
#include <torch/extension.h>
// PyBackend's trampolines are compiled here: the casters they use (setTimeout's duration) must be in this file
#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <unordered_map>

extern "C" {
int64_t fc_submit_if_idle(void*, int, intptr_t, intptr_t, intptr_t, intptr_t, intptr_t, intptr_t, intptr_t,
                          intptr_t);
int fc_wait(int64_t, long, intptr_t*);
int fc_done(int64_t);
}

namespace {

constexpr long kSliceMs = 200;  // how long a wait runs in C before it asks Python whether to go on

class FastBackend;

class FastWork : public c10d::Work {
 public:
  FastWork(c10::intrusive_ptr<FastBackend> group, int64_t ticket, std::vector<at::Tensor> tensors)
      : c10d::Work(-1, c10d::OpType::ALLREDUCE), group_(std::move(group)), ticket_(ticket),
        tensors_(std::move(tensors)) {}

  bool wait(std::chrono::milliseconds /*timeout: the group's own applies*/) override;

  bool isCompleted() override { return collected_ || fc_done(ticket_); }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  c10::intrusive_ptr<FastBackend> group_;
  int64_t ticket_;
  std::vector<at::Tensor> tensors_;
  bool collected_ = false;
};

class FastBackend : public c10d::PyBackend {
 public:
  FastBackend(int rank, int size) : c10d::PyBackend(rank, size) {}

  // What the fast path needs from the Python group, once its communicator exists.
  void configure(int64_t allreduce, int64_t comm, const std::vector<std::pair<at::ScalarType, int>>& dtypes,
                 std::unordered_map<int, int> ops, int64_t max_bytes) {
    allreduce_ = reinterpret_cast<void*>(allreduce);
    comm_ = comm;
    for (const auto& [dtype, library] : dtypes) {
      dtypes_[static_cast<int>(dtype)] = library;
    }
    ops_ = std::move(ops);
    max_bytes_ = max_bytes;
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    if (allreduce_ != nullptr && tensors.size() == 1) {
      const at::Tensor& t = tensors[0];
      auto dtype = dtypes_.find(static_cast<int>(t.scalar_type()));
      auto op = ops_.find(static_cast<int>(opts.reduceOp.op_));
      if (dtype != dtypes_.end() && op != ops_.end() && t.device().is_cpu() && t.is_contiguous() &&
          static_cast<int64_t>(t.nbytes()) <= max_bytes_) {
        auto ptr = reinterpret_cast<intptr_t>(t.data_ptr());
        int64_t ticket = fc_submit_if_idle(allreduce_, 7, ptr, ptr, t.numel(), dtype->second, op->second, comm_, 0, 0);
        if (ticket >= 0) {
          return c10::make_intrusive<FastWork>(c10::intrusive_ptr<FastBackend>::reclaim_copy(this), ticket, tensors);
        }
      }
    }
    return c10d::PyBackend::allreduce(tensors, opts);  // the Python group's, through torch's trampoline
  }

  // The Python group's answer about ``ticket`` (ticket_overdue: waited ``value`` seconds; ticket_error: returned
  // code ``value``): an error message, or empty to go on waiting.
  std::string ask(const char* method, int64_t ticket, double value, const std::vector<at::Tensor>& tensors) {
    pybind11::gil_scoped_acquire gil;
    pybind11::object self = pybind11::cast(static_cast<c10d::Backend*>(this));
    pybind11::object answer = self.attr(method)(ticket, value, tensors);
    return answer.is_none() ? std::string() : answer.cast<std::string>();
  }

  c10::intrusive_ptr<c10::ivalue::Future> future(int64_t ticket, const std::vector<at::Tensor>& tensors) {
    pybind11::gil_scoped_acquire gil;
    pybind11::object self = pybind11::cast(static_cast<c10d::Backend*>(this));
    pybind11::object fut = self.attr("ticket_future")(ticket, tensors);
    return pybind11::cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>(fut)->fut;
  }

 private:
  void* allreduce_ = nullptr;
  int64_t comm_ = 0;
  std::unordered_map<int, int> dtypes_, ops_;
  int64_t max_bytes_ = 0;
};

bool FastWork::wait(std::chrono::milliseconds) {
  if (collected_) {
    return true;
  }
  intptr_t rc = 0;
  auto start = std::chrono::steady_clock::now();
  while (!fc_wait(ticket_, kSliceMs, &rc)) {
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string why = group_->ask("ticket_overdue", ticket_, elapsed, tensors_);
    if (!why.empty()) {
      C10_THROW_ERROR(DistBackendError, why);
    }
  }
  if (rc != 0) {
    C10_THROW_ERROR(DistBackendError, group_->ask("ticket_error", ticket_, static_cast<double>(rc), tensors_));
  }
  collected_ = true;
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> FastWork::getFuture() {
  return group_->future(ticket_, tensors_);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<FastBackend, c10d::Backend, c10::intrusive_ptr<FastBackend>>(m, "FastBackend")
      .def(pybind11::init<int, int>())
      .def("_configure_fast", &FastBackend::configure);
}
