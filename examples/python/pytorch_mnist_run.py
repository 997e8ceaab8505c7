"""MNIST with PyTorch on hvd, launched from Python with ``hvd.run`` (Horovod's ``horovod.run``).

    python examples/python/pytorch_mnist_run.py --num-proc 2 --epochs 1 --data-dir ./data

With ``--num-proc`` the script starts its own job: ``hvd.run(train, ...)`` runs ``train`` on
every rank and returns what each returned, here its test accuracy. Without it, it is one
rank of a job ``horovodrun`` started (``horovodrun -np 2 python pytorch_mnist_run.py``).
The data is torchvision's MNIST under ``--data-dir``, downloaded when it is not there.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

import hvd
import hvd.torch as hvd_torch


class ConvNet(nn.Module):
    """Two convolutions and two dense layers: the classic MNIST network."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.drop(self.conv2(x)), 2))
        x = F.dropout(F.relu(self.fc1(x.flatten(1))), training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def mnist(args, train):
    """One split of MNIST, normalised, with a sampler giving this rank its share."""
    data = datasets.MNIST(args.data_dir, train=train, download=train, transform=transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]))
    sampler = DistributedSampler(data, num_replicas=hvd_torch.size(), rank=hvd_torch.rank())
    batch = args.batch_size if train else args.test_batch_size
    return DataLoader(data, batch_size=batch, sampler=sampler), sampler


def train(args):
    """Trains on this rank's share for ``args.epochs``; returns the test accuracy over all."""
    hvd_torch.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if hvd_torch.rank() == 0:
        # One rank downloads (if needed) while the others wait, then all read the files.
        mnist(args, train=True)
    hvd_torch.barrier()
    train_loader, train_sampler = mnist(args, train=True)
    test_loader, test_sampler = mnist(args, train=False)

    model = ConvNet()
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr * hvd_torch.size(),
                          momentum=args.momentum)
    hvd_torch.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd_torch.broadcast_optimizer_state(sgd, root_rank=0)
    optimizer = hvd_torch.DistributedOptimizer(sgd, named_parameters=model.named_parameters())

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
            if i % args.log_interval == 0:
                print(f"Train Epoch: {epoch} [{i * len(x)}/{len(train_sampler)}]"
                      f"\tLoss: {loss.item():.6f}")

        model.eval()
        loss_sum, correct = 0.0, 0.0
        with torch.no_grad():
            for x, y in test_loader:
                out = model(x)
                loss_sum += F.nll_loss(out, y, reduction="sum").item()
                correct += (out.argmax(1) == y).sum().item()
        # Every rank's share averaged over the ranks.
        loss = hvd_torch.allreduce(torch.tensor(loss_sum / len(test_sampler)), name="loss")
        accuracy = hvd_torch.allreduce(torch.tensor(correct / len(test_sampler)),
                                       name="accuracy")
        if hvd_torch.rank() == 0:
            print(f"\nTest set: Average loss: {loss.item():.4f}, "
                  f"Accuracy: {100 * accuracy.item():.2f}%\n")
    return accuracy.item()


def main():
    p = argparse.ArgumentParser(description="MNIST on hvd, launched by hvd.run")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--test-batch-size", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01, help="per rank; scaled by the size")
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-interval", type=int, default=10, help="batches between log lines")
    p.add_argument("--data-dir", default="./data", help="where MNIST is (downloaded if not)")
    p.add_argument("--num-proc", type=int, help="start a job of this many ranks with hvd.run")
    p.add_argument("--hosts", help="hosts of that job: host:slots[,host:slots...]")
    args = p.parse_args()
    if args.num_proc:
        print("Running training through hvd.run")
        accuracies = hvd.run(train, args=(args,), num_proc=args.num_proc, hosts=args.hosts)
        print(f"hvd.run returned the test accuracy of each rank: {accuracies}")
    else:
        train(args)


if __name__ == "__main__":
    main()
