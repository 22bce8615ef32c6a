"""The terminal commands of the engine (`treeattn generate`, `treeattn chat`, `treeattn linearize`).

    generate.py, generate_rank.py   `treeattn generate` (the command; what each rank runs)
    chat.py                         `treeattn chat`
    linearize.py                    `treeattn linearize`
    flags.py                        every flag derived from the config field it fills (all commands use it)
    console.py                      what the commands show on the terminal

treeattn/cli.py is the table of every command; serve, eval, bench and sim keep their own (cli.py
in their folder) and take their flags from flags.py.
"""
