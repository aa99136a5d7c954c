from wt_callbacks.receiver.cli import main

main()
