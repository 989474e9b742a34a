"""A fleet of ranks (one snapshot per rank of a job) as typed values: the rows (``rows``: a
``RankRow`` per file, the ``FleetReport``) and the outlier analysis with its verdicts
(``outliers``), and the Dask cluster a fleet's files may go to (``cluster``). What each file's
task is (the one per-file analysis, in its own limited child process or a Dask worker) is the
service's, ``memlens.ops.fleet``; here is what is made of the reports, and how they are gathered.
"""
