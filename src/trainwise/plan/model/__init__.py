"""The performance model the planner prices with: memory, compute (GEMMs, attention), collectives
over the network, cost and reliability."""
