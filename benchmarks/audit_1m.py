"""The factory for the audit scale figure: 1,000,000 samples, prepared, batch 512."""

from torch.utils.data import DataLoader, Dataset

N = 1_000_000


class Ints(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, index):
        return index

    def __getitems__(self, indices):
        return list(indices)


def make_loader(accelerator):
    return accelerator.prepare(DataLoader(Ints(), batch_size=512, shuffle=True))
