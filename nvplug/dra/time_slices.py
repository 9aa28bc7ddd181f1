"""A GPU's time-slice interval, as NVIDIA's DRA driver sets it: `nvidia-smi compute-policy -i <uuid>
--set-timeslice <n>`, with n the interval's number (Default 0, Short 1, Medium 2, Long 3).

NVML has no call that reads the interval in force, and nvidia-smi prints none. So nvplug keeps what it
set itself (in the claims checkpoint, before it sets it) and sets Default again when the last claim that
needs it is unprepared: the driver's own value after it loads, which nothing but nvplug changes on a
GPU that DRA owns.
"""

from __future__ import annotations

import logging
import shutil

from nvplug.base.child_process import run_child

log = logging.getLogger("nvplug.dra")

INTERVAL_NUMBERS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
DEFAULT_INTERVAL = "Default"
# nvidia-smi answers in well under a second; past this it hangs on the driver.
SMI_SECONDS = 30.0


class TimeSliceError(RuntimeError):
    """An interval that could not be set; the message names the GPU and what nvidia-smi said."""


class TimeSlicer:
    """Runs nvidia-smi (a child process, never a call on the loop) to set one GPU's interval."""

    def __init__(self, nvidia_smi: str = "nvidia-smi", timeout: float = SMI_SECONDS) -> None:
        self.nvidia_smi = nvidia_smi
        self._timeout = timeout

    async def set(self, uuid: str, interval: str) -> None:
        number = INTERVAL_NUMBERS[interval]
        command = shutil.which(self.nvidia_smi)
        if command is None:
            raise TimeSliceError(
                f"GPU {uuid}: cannot set the time-slice interval {interval}: {self.nvidia_smi} is not on PATH"
            )
        args = ("compute-policy", "-i", uuid, "--set-timeslice", str(number))
        what = f"nvidia-smi {' '.join(args)}"
        try:
            ran = await run_child((command, *args), self._timeout)
        except OSError as err:
            raise TimeSliceError(f"GPU {uuid}: {what} cannot run: {err}") from err
        if ran.returncode is None:
            raise TimeSliceError(f"GPU {uuid}: {what} did not end within {self._timeout:g} s")
        said = " / ".join(line.strip() for line in ran.output.splitlines() if line.strip())
        if ran.returncode != 0:
            raise TimeSliceError(f"GPU {uuid}: {what} failed with status {ran.returncode}: {said or 'no output'}")
        log.info("GPU %s: time-slice interval %s (%d) set", uuid, interval, number)
