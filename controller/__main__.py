from controller.cli.main import main

main()
