"""The fast tier (`make test-fast`): no process group, no training run; a test here may start a short
`python -c` or `zerodp plan` subprocess to check what a fresh interpreter imports or prints. The whole
tier runs in well under 90 s on 2 cores."""
