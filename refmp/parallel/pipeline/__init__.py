"""Pipeline parallelism (--pp): partition, schedules as data, simulator, executor, runner.

Read in this order: partition.py, schedules.py, simulate.py (and timeline.py), stage.py,
executor.py, runner.py. docs/pipeline.md explains the bubble and the schedules.
"""
