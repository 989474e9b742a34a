from memlens.cli.launch import main

main()
