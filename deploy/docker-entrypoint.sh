#!/bin/sh
# Entrypoint of the pdcluster image.
#
#   docker run IMAGE                      -> pdcluster serve (the CMD; the image sets
#                                            PDCLUSTER_HOST=0.0.0.0)
#   docker run IMAGE serve --prefill 2    -> pdcluster serve --prefill 2
#   docker run IMAGE --help               -> pdcluster --help
#   docker run IMAGE bash                 -> bash (the Ray cluster launcher starts its
#                                            containers this way)
#
# pdcluster's subcommands are named here rather than guessed from PATH: Ray installs a
# `serve` executable of its own (the Ray Serve CLI).
set -e
case "${1:-}" in
    "" | -* | serve | stop | drain | generate | status | scale | bench | profile | plan)
        set -- pdcluster "$@"
        ;;
esac
exec "$@"
