"""NVML's errors and its calls with deadlines, without pynvml: what the NVML source shares with the
parts that call NVML through it (MPS's compute modes, `POST /heal`)."""
