"""An elastic PyTorch job that proves no committed step is lost or applied twice, for the
tests: the ``elastic_counter`` events (JSON lines: start, reset, step, commit, done) from a
``TorchState`` holding a model trained by a ``DistributedOptimizer``, an ``ElasticSampler``
and the counter.

Each step allreduces ones (the world's size) into ``total`` and appends the size to
``history``; the model's one weight gets gradient 1 on every rank, so plain SGD with
learning rate 1 takes it to exactly ``-step``. At the end ``total`` equals the sum of
``history`` and the weight equals ``-steps``.
"""

import torch

import counter
import hvd.torch as hvd


def main():
    p = counter.parser(__doc__)
    p.add_argument("--op", choices=["average", "adasum"], default="average",
                   help="the DistributedOptimizer's op: every rank's gradient is the same, "
                        "so Adasum gives the same steps as the average")
    p.add_argument("--state-model", default=None,
                   help="a torchvision model (with SGD momentum state) to keep in the "
                        "TorchState besides the counter, to time recovery with a real state")
    p.add_argument("--train-state-model", action="store_true",
                   help="step the state model's optimizer at every step, writing every tensor "
                        "of it (its gradients are zero, so its values stay), where it is "
                        "otherwise held unchanged")
    args = p.parse_args()
    counter.start()
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   op=hvd.Adasum if args.op == "adasum" else hvd.Average)
    dataset = list(range(64))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
    extra = {}
    if args.state_model:
        import torchvision

        big = getattr(torchvision.models, args.state_model)()
        big_opt = torch.optim.SGD(big.parameters(), lr=0.0, momentum=0.9)
        for q in big.parameters():
            q.grad = torch.zeros_like(q)
        big_opt.step()  # creates the momentum buffers
        extra = {"big": big, "big_optimizer": big_opt}
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, step=0,
                                   total=0, history=[], **extra)
    calls = [0]
    resets = [0]
    state.register_reset_callbacks([lambda: resets.__setitem__(0, resets[0] + 1)])

    @hvd.elastic.run
    def train(state):
        rank, size = hvd.rank(), hvd.size()
        counter.entered(calls, state, rank, size)
        while state.step < args.steps:
            ones = hvd.allreduce(torch.ones(16, dtype=torch.int64), op=hvd.Sum)
            if not torch.all(ones == size):
                raise SystemExit(f"rank {rank}: allreduce of ones gave {ones.tolist()} in a "
                                 f"world of {size}")
            # Every rank takes the next batch of its part of the epoch.
            counter.take_batch(state.sampler, len(dataset))
            opt.zero_grad()
            model(torch.ones(1, 1)).sum().backward()
            opt.step()
            if args.train_state_model and args.state_model:
                extra["big_optimizer"].step()
            counter.stepped(state, rank, size)
            counter.commit_or_check(state, args, rank)
        return rank, size

    rank, size = train(state)
    counter.done(state, model.weight.item(), rank, size, resets[0], args.steps)
    hvd.shutdown()


if __name__ == "__main__":
    main()
