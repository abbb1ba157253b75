"""The job and its run directory, shared by the launcher and the workers: the job resolved against
the machine, the run files and lock, the lifeline to the launch, the versions check, each
process's place in the process group."""
