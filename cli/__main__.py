from mimo.cli.main import main

main()
