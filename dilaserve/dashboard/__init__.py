"""The dashboard page, shared by the live server (`GET /dashboard`) and simulator reports.

`timeline.Timeline` turns what happened (requests finished, steps run, queue and instances
sampled, reconfigurations begun) into bounded per-interval series; its `to_json` is the one data
shape the page draws. `page.live_page` and `page.static_page` wrap the same HTML, JavaScript and
CSS (`static/`, written here, no library) around a data URL to poll or embedded data. This
package knows neither the cluster nor the simulator: the server and `sim` feed it.
"""
