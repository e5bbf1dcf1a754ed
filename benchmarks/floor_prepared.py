"""The floor of a launch that shows a prepared loader: floor.py plus what any script that
prepares a DataLoader pays, and nothing of sharddemo: `accelerator.prepare` of a shuffled loader
of 8 samples (accelerate imports `datasets` there when it is installed, about 1 s here) and two
epochs walked."""

from accelerate import Accelerator
from torch.utils.data import DataLoader

accelerator = Accelerator(cpu=True)
loader = accelerator.prepare(DataLoader(list(range(8)), batch_size=4, shuffle=True))
for epoch in range(2):
    for batch in loader:
        accelerator.gather(batch)
accelerator.wait_for_everyone()
accelerator.end_training()
