"""Query-major tile + bar attention: a query block attends whole KV tiles and single key
columns (bars). ``kernels`` holds the Triton kernels, ``attention`` their autograd function
and launch configs, ``tables`` the tile tables an index becomes and ``tables_kernel`` the
one-launch Triton builder of a vertical-slash index's tables."""
