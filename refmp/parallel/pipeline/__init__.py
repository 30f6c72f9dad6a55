"""Pipeline parallelism (--pp): partition, schedules as data, simulator, executor, stage.

Read in this order: partition.py, schedules.py, simulate.py (and timeline.py), stage.py,
executor.py; catalog.py names every schedule with what callers ask of it, and
refmp/parallel/engine.py builds them for a layout (pp = 1 is a one-stage pipeline).
docs/pipeline.md explains the bubble and the schedules.
"""
