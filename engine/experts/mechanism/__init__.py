"""How the expert hierarchy's decisions are carried out: devices and their copy paths, CPU expert
workers (in-process, a process, or through the shared-memory ring), the host pool and the streamer."""
