"""Unit tests of trainwise.run.job.distributed.dist_env_from: the worker's place in the job from
torchrun's variables, Slurm's, or none."""

from __future__ import annotations

from trainwise.run.job.distributed import DistEnv, dist_env_from


def test_torchrun_variables():
    env = dist_env_from(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    )
    assert env == DistEnv(rank=3, world=8, local_rank=1, local_world=4, launched=True)
    assert env.is_main is False


def test_torchrun_without_local_variables():
    # No LOCAL_RANK / LOCAL_WORLD_SIZE: local rank 0, local world = the world (one node).
    env = dist_env_from({"RANK": "0", "WORLD_SIZE": "2"})
    assert env == DistEnv(rank=0, world=2, local_rank=0, local_world=2, launched=True)
    assert env.is_main is True


def test_torchrun_wins_over_slurm():
    env = dist_env_from({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "6"})
    assert (env.rank, env.world) == (1, 2)


def test_slurm_variables():
    env = dist_env_from(
        {
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "6",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS_PER_NODE": "2(x3)",  # 3 nodes of 2 tasks
        }
    )
    assert env == DistEnv(rank=5, world=6, local_rank=1, local_world=2, launched=True)


def test_slurm_plain_tasks_per_node():
    env = dist_env_from(
        {
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "0",
            "SLURM_NTASKS_PER_NODE": "4",
        }
    )
    assert env == DistEnv(rank=0, world=4, local_rank=0, local_world=4, launched=True)


def test_the_batch_script_of_an_allocation_is_not_a_worker():
    # sbatch's batch step has SLURM_PROCID=0 and SLURM_NTASKS>1 but is not an srun step.
    env = dist_env_from({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"})
    assert env.launched is False


def test_single_task_slurm_is_not_launched():
    env = dist_env_from({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"})
    assert env == DistEnv()
    assert env.launched is False


def test_empty_environment():
    env = dist_env_from({})
    assert env == DistEnv(rank=0, world=1, local_rank=0, local_world=1, launched=False)
    assert env.is_main is True


def test_rank_without_world_size_is_ignored():
    assert dist_env_from({"RANK": "1"}) == DistEnv()
