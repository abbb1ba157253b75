"""Starting a job on this machine: every check before any worker starts (data, another
lineage's checkpoint), torchrun's elastic agent, and the scheduler files for several
machines."""
