"""Elastic training with PyTorch on hvd: a small MLP on a generated two-class dataset, with
``hvd.elastic.TorchState``, ``ElasticSampler`` and ``DistributedOptimizer``.

    horovodrun -np 4 --min-np 2 --host-discovery-script ./discover.sh \\
        python examples/python/pytorch_elastic.py --epochs 5

Kill a worker or change the hosts while it trains: the job goes on at the new size. After
each epoch rank 0 prints the loss and accuracy on the whole dataset and checks the sampler:
across every rank and every reset of the epoch, each sample was trained on (none skipped;
a sample repeated only as padding, when the samples left do not divide evenly over the
ranks). Lines are JSON, one per epoch, then one "done".
"""

import argparse
import json
import time
import warnings

import torch
import torch.nn.functional as F

import hvd.torch as hvd

warnings.filterwarnings("ignore", message=".*NumPy.*")


def dataset(n, seed=0):
    """Two Gaussian blobs in 8 dimensions, labels 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + (y.float() * 2 - 1).unsqueeze(1) * 0.8
    return x, y


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the size")
    p.add_argument("--commit-every", type=int, default=4, help="batches between commits")
    p.add_argument("--batch-ms", type=float, default=0, help="sleep per batch (demos)")
    args = p.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    x, y = dataset(args.samples)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 2))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(list(range(args.samples)), shuffle=True, seed=1)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=0, trained=[])

    def on_reset():
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        # This rank's samples since the last commit; a failure rolls them back, so they are
        # only recorded (for every rank, in the committed state) at a commit.
        pending = []

        def commit():
            state.trained.extend(i for part in hvd.allgather_object(pending) for i in part)
            pending.clear()
            state.commit()

        while state.epoch < args.epochs:
            model.train()
            indices = list(state.sampler)
            for b, start in enumerate(range(0, len(indices), args.batch_size)):
                idx = indices[start:start + args.batch_size]
                optimizer.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                optimizer.step()
                pending.extend(idx)
                state.sampler.record_indices(idx)
                if args.batch_ms:
                    time.sleep(args.batch_ms / 1000)
                if b % args.commit_every == args.commit_every - 1:
                    commit()
            commit()
            # Every rank's samples of the epoch, through every reset of it.
            missing = sorted(set(range(args.samples)) - set(state.trained))
            with torch.no_grad():
                model.eval()
                out = model(x)
                loss = F.cross_entropy(out, y).item()
                accuracy = (out.argmax(1) == y).float().mean().item()
            if hvd.rank() == 0:
                print(json.dumps({"event": "epoch", "epoch": state.epoch, "size": hvd.size(),
                                  "loss": round(loss, 4), "accuracy": round(accuracy, 4),
                                  "samples": args.samples, "missing": len(missing),
                                  "repeated": len(state.trained) - len(set(state.trained))}),
                      flush=True)
            if missing:
                raise SystemExit(f"epoch {state.epoch}: {len(missing)} samples were never "
                                 f"trained on, first {missing[:5]}")
            state.epoch += 1
            state.trained = []
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        print(json.dumps({"event": "done", "epochs": args.epochs, "size": hvd.size()}),
              flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
