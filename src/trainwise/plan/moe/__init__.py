"""The planner's pricing of Mixture-of-Experts models, from their cost description
(models.moe.cost): memory (`memory`), compute (`compute`) and communication (`comm`),
each reached through the planner's own seams (plan.model.memory.estimate_memory,
plan.model.compute.compute_time, plan.estimate's communication) when a workload has
experts."""
