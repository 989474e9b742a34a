"""A fleet of ranks (one snapshot per rank of a job) as typed values: the rows (``rows``: a
``RankRow`` per file, the ``FleetReport``) and the outlier analysis with its verdicts
(``outliers``). Computing each row's report is the service's (``memlens.ops.fleet``: each file in
its own limited child process, or on a Dask cluster); here is only what is made of the reports.
"""
