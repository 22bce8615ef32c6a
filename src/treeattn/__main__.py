from treeattn.cli import main

main()
