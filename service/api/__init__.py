"""The HTTP process: the app and its routes, submit, readers, auth, admission, the ASGI
server and middleware, the sweeper, metrics."""
