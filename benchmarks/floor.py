"""The floor of any command that starts ranks: a 2-rank launch that only builds an Accelerator."""

from accelerate import Accelerator

accelerator = Accelerator(cpu=True)
accelerator.wait_for_everyone()
accelerator.end_training()
