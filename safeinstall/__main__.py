from safeinstall.cli import main

main()
