"""The runtime, in wings, each importing only from the wings below it:
launch/ (start-up checks, torchrun, scheduler files) > engine/ (the worker's model, step and
loop) > checkpoint/ (state on disk) > observe/ (telemetry and diagnosis) > job/ (the job and
its run directory, shared by launcher and workers). The tests' seam is
trainwise/faults.py, below every floor."""
