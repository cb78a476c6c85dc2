"""The ``pollux-run COMMAND`` launcher: options, hosts, framework detection, workers."""
