"""The HTTP server of `python -m <package>.serve`: the app (app.py), its guards and metrics
(guard.py), the one thread that runs the model (engine.py), the task's endpoints and the page
served at `/` (page.html)."""
