// hvd's compiled TensorFlow op: a group of tensors allreduced by hvd's background engine.
//
// `hvd.tensorflow` compiles this file against the installed TensorFlow's headers at first use
// (see graph_ops.py) and puts the op into graphs that `tf.function` traces. The op holds no
// logic of its own: it allocates its outputs, copies its inputs into them (or takes an input's
// buffer when TensorFlow can forward it), and hands their addresses to the entry point of
// hvd's native module (python/src/graph_op.rs), whose address Python sets with
// `hvd_set_grouped_allreduce`. The entry point calls `Finish` when every tensor is reduced or
// the group failed: at once for a single tensor, which it reduces on the calling thread, else
// from the engine's thread, and then `Finish` hands the op's end to TensorFlow's own threads,
// so that the engine's thread never runs the graph's next nodes.

#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

// The completion the entry point calls once: 0 for success, else 1 (a collective failed:
// HorovodInternalError), 2 (the hosts changed: HostsUpdatedInterrupt) or 3 (anything else),
// with a message of `len` bytes.
typedef void (*DoneFn)(void* ctx, int code, const char* msg, size_t len);

// python/src/graph_op.rs `grouped_allreduce`.
typedef void (*EntryFn)(size_t n, void* const* data, const size_t* counts, const int* dtypes,
                        const char* op, size_t op_len, double prescale, double postscale,
                        const char* name, size_t name_len, DoneFn done, void* ctx);

std::atomic<EntryFn> entry{nullptr};

// Asks the kernel for huge pages under a large output before it is first written, as numpy
// does for its large arrays: TensorFlow's allocator hands out fresh 4 KiB pages, and faulting
// in a ResNet-50's 100 MB of gradients page by page costs tens of milliseconds a step.
void PreferHugePages(void* data, size_t bytes) {
  const uintptr_t huge = uintptr_t{2} << 20;
  const uintptr_t at = reinterpret_cast<uintptr_t>(data);
  const uintptr_t start = (at + huge - 1) & ~(huge - 1);
  const uintptr_t end = (at + bytes) & ~(huge - 1);
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
}

// One op's run, kept until the engine ends it.
struct Run {
  OpKernelContext* context;
  AsyncOpKernel::DoneCallback done;
};

// Whether this thread is inside the entry point's call (which ends a single tensor's run
// there): its completion then returns to TensorFlow at once, on the thread TensorFlow gave.
thread_local bool in_entry = false;

void Finish(void* ctx, int code, const char* msg, size_t len) {
  Run* run = static_cast<Run*>(ctx);
  if (code != 0) {
    std::string text(msg, len);
    // hvd.tensorflow finds the exception's class name in the message and raises it.
    if (code == 1) {
      run->context->SetStatus(tensorflow::errors::Aborted("HorovodInternalError: ", text));
    } else if (code == 2) {
      run->context->SetStatus(tensorflow::errors::Aborted("HostsUpdatedInterrupt: ", text));
    } else {
      run->context->SetStatus(tensorflow::errors::InvalidArgument(text));
    }
  }
  auto done = std::move(run->done);
  auto* workers = run->context->device()->tensorflow_cpu_worker_threads();
  delete run;
  if (!in_entry && workers != nullptr && workers->workers != nullptr) {
    workers->workers->Schedule(std::move(done));
  } else {
    done();
  }
}

class HvdGroupedAllreduceOp : public AsyncOpKernel {
 public:
  explicit HvdGroupedAllreduceOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &reduce_op_));
    OP_REQUIRES_OK(c, c->GetAttr("prescale_factor", &prescale_));
    OP_REQUIRES_OK(c, c->GetAttr("postscale_factor", &postscale_));
  }

  void ComputeAsync(OpKernelContext* c, DoneCallback done) override {
    EntryFn call = entry.load();
    OP_REQUIRES_ASYNC(c, call != nullptr,
                      tensorflow::errors::FailedPrecondition(
                          "hvd's op library was loaded without hvd.tensorflow: import "
                          "hvd.tensorflow to use it"),
                      done);
    const int n = c->num_inputs();
    std::vector<void*> data(n);
    std::vector<size_t> counts(n);
    std::vector<int> dtypes(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& x = c->input(i);
      Tensor* y = nullptr;
      OP_REQUIRES_OK_ASYNC(c, c->forward_input_or_allocate_output({i}, i, x.shape(), &y), done);
      if (y->data() != x.data() && x.TotalBytes() > 0) {
        PreferHugePages(y->data(), x.TotalBytes());
        std::memcpy(y->data(), x.data(), x.TotalBytes());
      }
      data[i] = y->data();
      counts[i] = static_cast<size_t>(x.NumElements());
      dtypes[i] = static_cast<int>(x.dtype());
    }
    const std::string& node = name();
    in_entry = true;
    call(n, data.data(), counts.data(), dtypes.data(), reduce_op_.data(), reduce_op_.size(),
         prescale_, postscale_, node.data(), node.size(), Finish, new Run{c, std::move(done)});
    in_entry = false;
  }

 private:
  std::string reduce_op_;
  float prescale_ = 1.0f;
  float postscale_ = 1.0f;
};

}  // namespace

REGISTER_OP("HvdGroupedAllreduce")
    .Input("tensors: T")
    .Output("reduced: T")
    .Attr("T: list({uint8, int32, int64, half, bfloat16, float, double}) >= 1")
    .Attr("reduce_op: string")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    // Stateful: never folded, pruned or merged, and run in the order the program wrote it,
    // which is the same on every rank.
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return tensorflow::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("HvdGroupedAllreduce").Device(tensorflow::DEVICE_CPU),
                        HvdGroupedAllreduceOp);

extern "C" __attribute__((visibility("default"))) void hvd_set_grouped_allreduce(void* fn) {
  entry.store(reinterpret_cast<EntryFn>(fn));
}
