"""The preflight checklist: the job's checks and micro-benchmarks, run on every rank of the
machines it will use (`trainwise doctor`)."""
