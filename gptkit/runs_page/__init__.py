"""The runs under a folder, side by side: `gptkit runs` (a table in the terminal), `gptkit runs serve` (a
local page: the table, curves overlaid, configs compared, live runs updating) and `gptkit compare` (the
curves as one PNG). It reads the run folders only (docs/runs-page.md):

    scan.py      which folders are runs, and one bounded summary each (the table's row, the status rule)
    series.py    a run's curves from its metrics.csv, streamed and thinned to a bounded number of points
    compare.py   the PNG of `gptkit compare`
    app.py       the page's routes (Starlette, on gptkit/serve/http.py's stack) and page.html
"""
