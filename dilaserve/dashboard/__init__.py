"""The dashboard page, shared by the live server (`GET /dashboard`) and simulated runs.

`timeline.Timeline` turns what happened (requests finished, steps run, queue and instances
sampled, reconfigurations begun) into bounded per-interval series; its `to_json` is the one data
shape the page draws. The page is `static/` (HTML, JavaScript and CSS written here, no library):
`page.live_page` inlines it around a data URL to poll, `page.static_page` around embedded data,
and a simulated run's folder holds only its data (`page.write_data`, `dashboard-data.js`), which
`serve.py` serves with the page. This package knows neither the cluster nor the simulator: the
server and `sim` feed it.
"""
